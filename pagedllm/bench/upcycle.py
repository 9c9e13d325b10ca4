"""`pagedllm bench upcycle DENSE.gguf OUT.gguf`: a mixture-of-experts GGUF made from a real dense
one, whose every expert is a copy of the dense model's MLP ("sparse upcycling", untrained).

No real MoE checkpoint can be fetched here, and random weights prove only the arithmetic. This
file runs the MoE paths (the 3-D expert tensors, the router, top k, the expert kernels, the
weighted sum) on real weights and real activations, with a known answer: the routing weights of
a row sum to one and its experts are the same function, so the model computes what the dense
model computes, whichever experts the random router picks. Its text is the dense model's text,
and its greedy tokens are the dense model's up to the rounding of the weighted sum.

The experts hold the dense file's bytes unchanged (no requantization), so the quantized kernels
read the weights the dense model reads. The router (`ffn_gate_inp`, F32) is seeded random.

- `llama` (Llama, Mistral, SmolLM2) -> `llama` with an expert count: Mixtral's layout, top k
  then softmax;
- `qwen2` -> `qwen2moe` without a shared expert, `qwen3` -> `qwen3moe`: softmax, top k,
  renormalized (`expert_weights_norm` written, which Qwen2-MoE does not do by default).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path


logger = logging.getLogger(__name__)

# The dense architecture -> the MoE architecture that holds its layers unchanged.
MOE_ARCH = {"llama": "llama", "qwen2": "qwen2moe", "qwen3": "qwen3moe"}
_MLP = ("ffn_gate", "ffn_up", "ffn_down")


def upcycle(src: Path, dst: Path, experts: int = 4, used: int = 2, seed: int = 0) -> dict:
    """Write dst from the dense GGUF src; returns a summary (architectures, expert counts, bytes)."""
    import numpy as np

    import gguf

    if not 1 <= used <= experts:
        raise ValueError(f"--experts-used {used} must be between 1 and --experts {experts}")
    try:
        reader = gguf.GGUFReader(str(src))
    except (ValueError, OSError) as e:
        raise ValueError(f"{src}: not a GGUF file that can be read ({e})") from None
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise ValueError(f"{src}: no general.architecture: not a model GGUF")
    arch = str(arch_field.contents())
    if arch not in MOE_ARCH:
        raise ValueError(
            f"{src}: architecture {arch!r} has no MoE counterpart here; upcycle takes {', '.join(sorted(MOE_ARCH))}"
        )
    moe = MOE_ARCH[arch]
    if f"{arch}.expert_count" in reader.fields:
        raise ValueError(f"{src}: already a mixture of experts ({arch}.expert_count is set)")
    writer = gguf.GGUFWriter(str(dst), arch=moe)
    hidden, ffn = _copy_metadata(reader, writer, arch, moe)
    if not hidden or not ffn:
        raise ValueError(f"{src}: {arch}.embedding_length or {arch}.feed_forward_length is missing")
    writer.add_uint32(f"{moe}.expert_count", experts)
    writer.add_uint32(f"{moe}.expert_used_count", used)
    if moe != "llama":
        writer.add_uint32(f"{moe}.expert_feed_forward_length", ffn)
        writer.add_bool(f"{moe}.expert_weights_norm", True)
    rng = np.random.default_rng(seed)
    layers_done = set()
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _MLP and parts[3] == "weight":
            # [rows, bytes per row] (quantized) or [rows, cols] (float), repeated per expert.
            data = np.ascontiguousarray(np.broadcast_to(t.data, (experts, *t.data.shape)))
            writer.add_tensor(f"blk.{parts[1]}.{parts[2]}_exps.weight", data, raw_dtype=t.tensor_type)
            if parts[1] not in layers_done:
                layers_done.add(parts[1])
                router = rng.standard_normal((experts, hidden)).astype(np.float32)
                writer.add_tensor(f"blk.{parts[1]}.ffn_gate_inp.weight", router)
            continue
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    if not layers_done:
        raise ValueError(f"{src}: no blk.N.ffn_gate / ffn_up / ffn_down weights to copy into experts")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {
        "from": arch,
        "to": moe,
        "experts": experts,
        "used": used,
        "layers": len(layers_done),
        "bytes": dst.stat().st_size,
    }


def _copy_metadata(reader, writer, arch: str, moe: str) -> tuple[int, int]:
    """The dense file's metadata under the MoE architecture's names; (hidden size, MLP width)."""
    import gguf

    hidden = ffn = 0
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # (the writer writes its own header and architecture)
        name = moe + key[len(arch) :] if key.startswith(arch + ".") else key
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        writer.add_key_value(name, value, vtype, sub)
        if key == f"{arch}.embedding_length":
            hidden = int(value)
        elif key == f"{arch}.feed_forward_length":
            ffn = int(value)
    return hidden, ffn


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "dense", metavar="DENSE.gguf", help="a dense llama, qwen2 or qwen3 GGUF ('default': the embedded SmolLM2)"
    )
    p.add_argument("output", metavar="OUT.gguf", help="file to write (best outside the repository)")
    p.add_argument("--experts", type=int, default=4, help="experts per layer (default: %(default)s)")
    p.add_argument("--experts-used", type=int, default=2, help="experts per token (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the routers' seed")


def run(args: argparse.Namespace) -> int:
    from ..loading.source import default_model_path

    src = default_model_path() if args.dense == "default" else Path(args.dense).expanduser()
    if not src.is_file():
        raise SystemExit(f"{src}: no such GGUF file")
    out = Path(args.output).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        s = upcycle(src, out, args.experts, args.experts_used, args.seed)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(
        f"wrote {out} in {time.perf_counter() - t0:.0f} s: {s['from']} -> {s['to']}, {s['layers']} layers of "
        f"{s['experts']} experts ({s['used']} per token), {s['bytes'] / 1e6:.0f} MB. Every expert is the dense "
        f"MLP, so its text should be {src.name}'s."
    )
    return 0
