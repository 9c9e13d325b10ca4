"""`pagedllm bench gptq-pair MODEL.gguf`: one model's weights as a GPTQ checkpoint and as a Q4_0
GGUF, both run by our engine in one run: batch-1 decode and `--parallel` sequences decoded together.

The pair is built once from the same real weights, under `--dir` (default
~/.cache/pagedllm/bench/), and reused by later runs (`--rebuild` makes it again):

- `<stem>-q4_0.gguf`: llama.cpp's quantizer (llama-cpp-python) requantizes MODEL.gguf to Q4_0,
  with its usual per-tensor choices (the output head in Q6_K, or Q8_0 where 256-value blocks do
  not tile its rows; `--pure`: every matrix in Q4_0);
- `<stem>-gptq-<bits>bit-g<group>/`: transformers' float load of MODEL.gguf (`gguf_file=`), each
  decoder linear weight quantized round-to-nearest, symmetric, in groups (GPTQ's format without
  its Hessian search: the speed does not depend on the values), packed by gptqmodel's own
  TorchLinear.pack and written as a v1 checkpoint (desc_act false); embeddings, norms and a head
  stay float16, as GPTQ tools leave them; the tokenizer is saved with it.

Each figure comes from `--rounds` fresh processes per model (bench/compare.py's child: a
warm-up, then `--repeats` timed runs), the two models alternating, with the same prompt tokens
and KV room for both. The ratio is GPTQ / GGUF, the median of the rounds' ratios: a VM's speed
drifts by tens of percent within a minute, and one process per model in turn measured that
drift as a 0.82x gap that alternating in one process showed was not there. gptqmodel needs torch >= 2.14 by its metadata: `pip install --no-deps
gptqmodel` and its small dependencies (as tests/test_gptq.py says).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

import argparse
import ctypes
import json
import logging
import statistics
import sys
import time
from pathlib import Path

from .common import machine_info, write_json

logger = logging.getLogger(__name__)

MEASURES = ("decode1", "parallel")
MODELS = ("gguf", "gptq")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.gguf", help="the GGUF whose weights both sides are made from")
    p.add_argument(
        "--dir", default="~/.cache/pagedllm/bench", help="where the pair is built and kept (default %(default)s)"
    )
    p.add_argument("--rebuild", action="store_true", help="build the pair again even if it is there")
    p.add_argument(
        "--pure", action="store_true", help="llama.cpp quantizes every matrix to Q4_0 (no Q6_K/Q8_0 output head)"
    )
    p.add_argument("--group-size", type=int, default=128, help="GPTQ group size (default 128)")
    p.add_argument("--build-only", action="store_true", help="build the pair and stop")
    p.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per process; medians reported")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="processes per model and figure, the two models alternating (GGUF, GPTQ, GPTQ, "
        "GGUF, ...); the ratio is the median of the rounds' ratios (default 3)",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per sequence")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length of the decode tests")
    p.add_argument("--context", type=int, default=1024, help="KV room of the batch-1 test, in tokens")
    p.add_argument("--parallel", type=int, default=32, help="sequences decoded together (default 32)")
    p.add_argument("--measures", default=",".join(MEASURES), help=f"comma-separated subset of {','.join(MEASURES)}")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt tokens")
    p.add_argument("--dtype", default=None, help="pagedllm's dtype (default: the engine's choice)")
    p.add_argument("--output", default=None, help="JSON file (default bench-results/gptq-pair-<model>.json)")


def paths(model: Path, out_dir: Path, bits: int, group_size: int, pure: bool) -> dict[str, Path]:
    return {
        "gguf": out_dir / f"{model.stem}-q4_0{'-pure' if pure else ''}.gguf",
        "gptq": out_dir / f"{model.stem}-gptq-{bits}bit-g{group_size}",
    }


# -- building the pair ----------------------------------------------------------------------------


def build_q4_0(src: Path, dst: Path, threads: int, pure: bool) -> None:
    """llama.cpp's quantizer, requantizing `src` (itself quantized) to Q4_0."""
    from .make_gguf import LLAMA_FTYPES, _has_llama_cpp
    from .llamacpp_peer import MISSING_HINT, silence

    if not _has_llama_cpp():
        raise RuntimeError(f"the Q4_0 GGUF is made by llama.cpp's quantizer: {MISSING_HINT}")
    import llama_cpp

    silence(llama_cpp)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES["Q4_0"]
    params.nthread = threads
    params.allow_requantize = True  # the source is a quantized file
    params.pure = pure
    tmp = dst.with_suffix(".part")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama.cpp could not requantize {src} to Q4_0 (code {rc})")
    tmp.rename(dst)


def _gptqmodel():
    try:
        from gptqmodel.nn_modules.qlinear.torch import TorchLinear
        from gptqmodel.utils.model import convert_gptq_v2_to_v1_format_module
    except ImportError as e:
        raise RuntimeError(
            f"the GPTQ checkpoint is packed by gptqmodel ({e}): `pip install --no-deps "
            "gptqmodel` and its small dependencies"
        ) from None
    return TorchLinear, convert_gptq_v2_to_v1_format_module


def rtn_sym(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric scales and zeros per (row, group) of w [out, in], in GPTQ's
    convention (zero at the midpoint, scale = absmax / (maxq // 2), so pack's rounding stays in
    range), and the g_idx of contiguous groups."""
    import torch

    out_f, in_f = w.shape
    maxq = 2**bits - 1
    groups = w.float().view(out_f, in_f // group_size, group_size)
    scales = (groups.abs().amax(-1) / (maxq // 2)).clamp(min=1e-8).half().float()
    zeros = torch.full_like(scales, (maxq + 1) / 2)
    return scales, zeros, torch.arange(in_f, dtype=torch.int32) // group_size


def gptq_tensors(w: torch.Tensor, bias: torch.Tensor | None, bits: int, group_size: int) -> dict[str, torch.Tensor]:
    """A GPTQ v1 layer's tensors (qweight, qzeros, scales, g_idx[, bias]) for float weight w,
    packed by gptqmodel."""
    import torch

    from types import SimpleNamespace

    TorchLinear, to_v1 = _gptqmodel()
    out_f, in_f = w.shape
    scales, zeros, g_idx = rtn_sym(w, bits, group_size)
    lin = torch.nn.Linear(in_f, out_f, bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias is not None:
            lin.bias.copy_(bias)
    m = TorchLinear(
        bits=bits,
        group_size=group_size,
        sym=True,
        desc_act=False,
        in_features=in_f,
        out_features=out_f,
        bias=bias is not None,
    )
    m.pack(lin, scales, zeros, g_idx)
    to_v1(m, SimpleNamespace(bits=bits, pack_dtype=torch.int32))  # a v1 file stores zeros - 1
    out = {"qweight": m.qweight, "qzeros": m.qzeros, "scales": m.scales.half(), "g_idx": m.g_idx.int()}
    if bias is not None:
        out["bias"] = bias.half()
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def build_gptq(src: Path, dst: Path, bits: int, group_size: int) -> None:
    """transformers' float load of the GGUF, its decoder linear weights packed by gptqmodel."""
    import torch

    import transformers as tf
    from safetensors.torch import save_file

    _gptqmodel()  # fail before the slow load
    tok = tf.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = tf.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    sd: dict[str, torch.Tensor] = {}
    linears = {name for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear) and ".layers." in name}
    for name, t in model.state_dict().items():
        prefix = name.rsplit(".", 1)[0]
        if prefix in linears or (name == "lm_head.weight" and model.config.tie_word_embeddings):
            continue
        sd[name] = t.detach().half().contiguous()
    t0 = time.perf_counter()
    for i, name in enumerate(sorted(linears)):
        mod = model.get_submodule(name)
        sd.update({f"{name}.{k}": v for k, v in gptq_tensors(mod.weight.detach(), mod.bias, bits, group_size).items()})
        if i % 24 == 0:
            logger.info("packed %d/%d linear weights (%.0f s)", i + 1, len(linears), time.perf_counter() - t0)
    tmp = dst.with_name(dst.name + ".part")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    cfg["torch_dtype"] = "float16"
    cfg["quantization_config"] = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "sym": True,
        "desc_act": False,
        "checkpoint_format": "gptq",
    }
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(str(tmp))
    tmp.rename(dst)


def build_pair(args: argparse.Namespace, model: Path) -> dict[str, Path]:
    out_dir = Path(args.dir).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    pair = paths(model, out_dir, 4, args.group_size, args.pure)
    for kind, path in pair.items():
        if path.exists() and not args.rebuild:
            print(f"{kind}: {path} (built before; --rebuild to make it again)", file=sys.stderr)
            continue
        if path.is_dir():
            import shutil

            shutil.rmtree(path)
        t0 = time.perf_counter()
        print(f"{kind}: building {path} ...", file=sys.stderr, flush=True)
        if kind == "gguf":
            build_q4_0(model, path, args.threads, args.pure)
        else:
            build_gptq(model, path, 4, args.group_size)
        print(f"{kind}: built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return pair


# -- measuring ------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict | int:
    try:
        return _run(args)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> dict | int:
    from . import compare

    model = Path(args.model).expanduser()
    if model.suffix != ".gguf" or not model.is_file():
        raise RuntimeError(f"{model}: bench gptq-pair builds its pair from a .gguf file")
    measures = [m.strip() for m in args.measures.split(",") if m.strip()]
    bad = [m for m in measures if m not in MEASURES]
    if bad or not measures:
        raise RuntimeError(f"--measures: unknown {bad or 'empty list'}; choose from {', '.join(MEASURES)}")
    pair = build_pair(args, model)
    if args.build_only:
        return 0
    vocab = compare.weight_bytes(pair["gguf"])["vocab"]
    engine_kwargs = {"dtype": args.dtype} if args.dtype else {}
    out = args.output or f"bench-results/gptq-pair-{model.stem}.json"
    result: dict = {
        "source": str(model),
        "models": {k: str(v) for k, v in pair.items()},
        "machine": {**machine_info(), **compare.cpu_info(), "threads": args.threads},
        "repeats": args.repeats,
        "rounds": args.rounds,
        "engine_kwargs": engine_kwargs,
        "measures": {},
    }
    cargs = argparse.Namespace(**{**vars(args), "prefill_tokens": 1})
    for kind in measures:
        row: dict = {"round_ratios": []}
        specs = {
            which: compare._spec(kind, cargs, str(pair[which]), vocab) | {"engine_kwargs": engine_kwargs}
            for which in MODELS
        }  # the same prompts and KV room for both
        row["sequences"] = len(specs["gguf"]["prompts"])
        runs: dict = {which: [] for which in MODELS}
        for rnd in range(args.rounds):  # alternating, so a drift of the machine's speed hits both
            got = {}
            for which in MODELS if rnd % 2 == 0 else MODELS[::-1]:
                print(f"{kind}, round {rnd + 1}: {which} ...", file=sys.stderr, end=" ", flush=True)
                r = compare._spawn("pagedllm", specs[which])
                got[which] = compare._summarise(r) | {"weights": r.get("weights")}
                runs[which] += got[which]["tok_s_runs"]
                print(
                    f"{got[which]['tok_s']:.1f} tok/s (runs {', '.join(f'{x:.1f}' for x in got[which]['tok_s_runs'])})",
                    file=sys.stderr,
                    flush=True,
                )
            row["round_ratios"].append(got["gptq"]["tok_s"] / got["gguf"]["tok_s"])
            for which in MODELS:
                row[which] = got[which] | {"tok_s": statistics.median(runs[which]), "tok_s_runs": runs[which]}
        row["ratio"] = statistics.median(row["round_ratios"])
        result["measures"][kind] = row
        write_json(out, result)
    print(format_report(result))
    print(f"results written to {write_json(out, result)}")
    return result


def format_report(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"source: {result['source']}",
        f"cpu: {m.get('cpu') or m.get('machine')}; flags: {' '.join(m['cpu_flags']) or 'none of note'}; "
        f"{m['threads']} threads; {result.get('rounds', 1)} alternating rounds of {result['repeats']} runs per "
        "model; tok/s: median of all runs; ratio: median of the rounds' ratios",
        "",
    ]
    head = f"{'':<34}{'Q4_0 GGUF':>12}{'GPTQ':>12}{'ratio':>9}"
    lines += [head, "-" * len(head)]
    for kind, row in result["measures"].items():
        label = "decode, batch 1 (tok/s)" if kind == "decode1" else f"{row['sequences']} sequences decoded (tok/s)"
        lines.append(f"{label:<34}{row['gguf']['tok_s']:>12.1f}{row['gptq']['tok_s']:>12.1f}{row['ratio']:>8.2f}x")
        for which in MODELS:
            runs = ", ".join(f"{x:.1f}" for x in row[which]["tok_s_runs"])
            lines.append(f"  {which} runs: {runs}")
        if row.get("round_ratios"):
            lines.append(f"  rounds' ratios: {', '.join(f'{x:.2f}x' for x in row['round_ratios'])}")
    for which in MODELS:
        w = next((r[which].get("weights") for r in result["measures"].values() if r[which].get("weights")), None)
        lines.append(f"{which}: {result['models'][which]}" + (f"\n  weights: {w}" if w else ""))
    lines.append("ratio = GPTQ / Q4_0 GGUF")
    return "\n".join(lines)
