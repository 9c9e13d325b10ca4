"""`pagedllm bench make-gguf OUT.gguf`: a GGUF with a real model's dimensions and seeded random
weights, for speed and memory benchmarks where no hub can be reached.

The shapes are real (Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads, 2 KV heads, ...), so the
bytes streamed per token and the GEMM shapes are those of the real model; only the values are
random (std 0.02, like a fresh init), so the text it generates is meaningless. The tokenizer is
the default model's byte-level BPE (SmolLM2), padded with unused tokens up to the vocabulary size,
so that both llama.cpp and our loader accept the file.

MoE shapes (`olmoe-1b-7b`, `qwen3-30b-a3b-l12`) are written as llama.cpp's `olmoe` / `qwen3moe`
architectures, with each layer's experts in 3-D tensors `ffn_{gate,up,down}_exps` and the router
`ffn_gate_inp` in F32, as llama.cpp's converter writes them. Tensors are generated and written one
at a time, so a 14 GB F16 intermediate needs well under 1 GB of memory.

The file is written as F16 (F32 for norms and biases) through `gguf.GGUFWriter`; any other type
(Q4_K_M, Q8_0, ...) is then made by llama.cpp's own quantizer (llama-cpp-python), exactly as a
user would make it, including its per-tensor choices (e.g. fallbacks where rows are not a
multiple of 256).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .llamacpp_peer import MISSING_HINT, silence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float = 1e-6
    arch: str = "qwen2"  # llama.cpp's architecture name
    experts: int = 0  # > 0: a mixture of experts (`intermediate` is then each expert's)
    experts_used: int = 0
    dense_intermediate: int = 0  # qwen3moe's feed_forward_length (not used by its MoE layers)
    head_dim_: int = 0  # 0: hidden / heads
    tied: bool = True  # the embedding serves as the LM head

    @property
    def head_dim(self) -> int:
        return self.head_dim_ or self.hidden // self.heads


SHAPES = {
    # Qwen2.5-0.5B(-Instruct)'s config.json: 494M parameters, embeddings tied.
    "qwen2.5-0.5b": Shape(
        hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936, context=32768, rope_theta=1e6
    ),
    # Qwen2.5-1.5B and -3B: the same family larger, to show how the fixed costs of a process
    # (the Python runtime, torch) weigh less as the weights grow. Embeddings tied, as theirs are.
    "qwen2.5-1.5b": Shape(
        hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936, context=32768, rope_theta=1e6
    ),
    "qwen2.5-3b": Shape(
        hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008, vocab=151936, context=32768, rope_theta=1e6
    ),
    # Qwen3-0.6B's config.json: per-head q/k norms, head_dim 128 apart from hidden / heads, no
    # q/k/v bias, embeddings tied. Its GGUF architecture is llama.cpp's `qwen3`.
    "qwen3-0.6b": Shape(
        hidden=1024,
        layers=28,
        heads=16,
        kv_heads=8,
        intermediate=3072,
        vocab=151936,
        context=40960,
        rope_theta=1e6,
        arch="qwen3",
        head_dim_=128,
    ),
    # OLMoE-1B-7B(-0924)'s config.json: 6.9B parameters, 1.3B active (64 experts of 1024, top 8,
    # not renormalized), q/k norms over the whole projection, untied head. F16 intermediate 13.8 GB.
    "olmoe-1b-7b": Shape(
        hidden=2048,
        layers=16,
        heads=16,
        kv_heads=16,
        intermediate=1024,
        vocab=50304,
        context=4096,
        rope_theta=1e4,
        rms_eps=1e-5,
        arch="olmoe",
        experts=64,
        experts_used=8,
        tied=False,
    ),
    # Qwen3-30B-A3B's width (128 experts of 768, top 8, head_dim 128, 4 KV heads, per-head q/k
    # norms, untied head) with 12 of its 48 layers: 8.1B parameters, so that the F16
    # intermediate (16 GB) and the Q4_K_M file (about 5 GB) fit this machine's disk and memory.
    "qwen3-30b-a3b-l12": Shape(
        hidden=2048,
        layers=12,
        heads=32,
        kv_heads=4,
        intermediate=768,
        vocab=151936,
        context=40960,
        rope_theta=1e6,
        arch="qwen3moe",
        experts=128,
        experts_used=8,
        dense_intermediate=6144,
        head_dim_=128,
        tied=False,
    ),
    # A few MB, for tests: still pads the tokenizer, so the padding path is exercised.
    "tiny": Shape(
        hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=49152 + 64, context=2048, rope_theta=1e6
    ),
    "tiny-qwen3": Shape(
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=128,
        vocab=49152 + 64,
        context=2048,
        rope_theta=1e6,
        arch="qwen3",
        head_dim_=32,
    ),
    "tiny-olmoe": Shape(
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=4,
        intermediate=32,
        vocab=49152 + 64,
        context=2048,
        rope_theta=1e4,
        rms_eps=1e-5,
        arch="olmoe",
        experts=8,
        experts_used=2,
        tied=False,
    ),
    "tiny-qwen3moe": Shape(
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=32,
        vocab=49152 + 64,
        context=2048,
        rope_theta=1e6,
        arch="qwen3moe",
        experts=8,
        experts_used=2,
        dense_intermediate=128,
        head_dim_=32,
        tied=False,
    ),
}

# The llama.cpp file types this command can make (name -> llama_ftype value in llama.h).
LLAMA_FTYPES = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q2_K": 10,
    "Q3_K_M": 12,
    "Q4_K_S": 14,
    "Q4_K_M": 15,
    "Q5_K_S": 16,
    "Q5_K_M": 17,
    "Q6_K": 18,
}


def tokenizer_metadata(vocab: int) -> dict:
    """The default model's byte-level BPE tokenizer, padded with unused tokens to `vocab`."""
    import gguf

    from ..loading.source import default_model_path

    reader = gguf.GGUFReader(str(default_model_path()))
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    if vocab < len(tokens):
        raise ValueError(f"vocab {vocab} is smaller than the tokenizer's {len(tokens)} tokens")
    # Unique, and unreachable by the merges: as Qwen's own GGUFs pad their vocabulary.
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    types += [int(gguf.TokenType.UNUSED)] * (vocab - len(types))
    meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"] = tokens, types
    return meta


def write_random(path: Path, shape: Shape, seed: int, ftype: str = "F16", std: float = 0.02) -> None:
    """A GGUF of `shape.arch` (qwen2, qwen3, olmoe, qwen3moe): F16 (or F32) matrices, F32 norms, biases
    and routers. Each tensor is generated as it is written."""
    import numpy as np

    import gguf

    mat_dtype = {"F16": np.float16, "F32": np.float32}[ftype]
    rng = np.random.default_rng(seed)
    tok = tokenizer_metadata(shape.vocab)
    arch = shape.arch
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name(f"random {arch} {shape.hidden}x{shape.layers} (seed {seed})")
    w.add_file_type(LLAMA_FTYPES[ftype])
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.dense_intermediate or shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    if shape.head_dim_:
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(shape.intermediate)
    w.add_vocab_size(shape.vocab)
    _add_tokenizer(w, tok)

    plan = tensor_plan(shape)  # (name, numpy shape, "matrix" | "norm" | "bias" | "router")
    for name, dims, kind in plan:
        dtype = mat_dtype if kind == "matrix" else np.float32
        w.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, dims, kind in plan:
        if kind == "norm":
            a = 1.0 + rng.standard_normal(dims, dtype=np.float32) * std
        elif kind == "bias":
            a = rng.standard_normal(dims, dtype=np.float32) * std
        else:  # matrices [out, in] (experts [E, out, in]), as GGUFWriter expects numpy order
            a = rng.standard_normal(dims, dtype=np.float32) * std
            if kind == "matrix":
                a = a.astype(mat_dtype)
        w.write_tensor_data(a)
        del a
    w.close()


def _add_tokenizer(w, tok: dict) -> None:
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(tok["tokenizer.ggml.tokens"])
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    w.add_bos_token_id(int(tok["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(tok["tokenizer.ggml.eos_token_id"]))
    w.add_add_bos_token(False)
    if "tokenizer.chat_template" in tok:
        w.add_chat_template(tok["tokenizer.chat_template"])


def write_qwen2(path: Path, shape: Shape, seed: int, ftype: str = "F16", std: float = 0.02) -> None:
    """The dense shapes' writer (kept by name for callers)."""
    write_random(path, shape, seed, ftype, std)


def tensor_plan(shape: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """The tensors llama.cpp's loader expects for `shape.arch`, in writing order."""
    h, hd = shape.hidden, shape.head_dim
    q, kv = shape.heads * hd, shape.kv_heads * hd
    plan = [("token_embd.weight", (shape.vocab, h), "matrix")]
    for i in range(shape.layers):
        b = f"blk.{i}."
        plan.append((b + "attn_norm.weight", (h,), "norm"))
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            plan.append((b + name + ".weight", (rows, h), "matrix"))
            if shape.arch == "qwen2":
                plan.append((b + name + ".bias", (rows,), "bias"))
        plan.append((b + "attn_output.weight", (h, q), "matrix"))
        if shape.arch == "olmoe":  # over the whole projection
            plan += [(b + "attn_q_norm.weight", (q,), "norm"), (b + "attn_k_norm.weight", (kv,), "norm")]
        elif shape.arch in ("qwen3", "qwen3moe"):  # per head
            plan += [(b + "attn_q_norm.weight", (hd,), "norm"), (b + "attn_k_norm.weight", (hd,), "norm")]
        plan.append((b + "ffn_norm.weight", (h,), "norm"))
        inter = shape.intermediate
        if shape.experts:
            e = shape.experts
            plan += [
                (b + "ffn_gate_inp.weight", (e, h), "router"),
                (b + "ffn_gate_exps.weight", (e, inter, h), "matrix"),
                (b + "ffn_down_exps.weight", (e, h, inter), "matrix"),
                (b + "ffn_up_exps.weight", (e, inter, h), "matrix"),
            ]
        else:
            plan += [
                (b + "ffn_gate.weight", (inter, h), "matrix"),
                (b + "ffn_up.weight", (inter, h), "matrix"),
                (b + "ffn_down.weight", (h, inter), "matrix"),
            ]
    plan.append(("output_norm.weight", (h,), "norm"))
    if not shape.tied:
        plan.append(("output.weight", (shape.vocab, h), "matrix"))
    return plan


def quantize_with_llama_cpp(src: Path, dst: Path, ftype: str, threads: int) -> None:
    try:
        import llama_cpp
    except ImportError:
        raise RuntimeError(f"quantizing to {ftype} uses llama.cpp's quantizer: {MISSING_HINT}") from None
    silence(llama_cpp)  # it logs every tensor; the summary after names the types it chose
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[ftype]
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype} (code {rc})")


def check_opens(path: Path, with_llama_cpp: bool) -> dict:
    """Open the file with our loader and (when installed) with llama.cpp; a summary of its tensors."""
    import numpy as np

    from collections import Counter

    from ..loading.gguf import read_gguf

    ckpt = read_gguf(path)
    reader = ckpt._reader
    types = Counter(t.tensor_type.name for t in reader.tensors)
    params = sum(int(np.prod(t.shape)) for t in reader.tensors)
    summary = {
        "path": str(path),
        "bytes": path.stat().st_size,
        "parameters": params,
        "tensor_types": dict(types),
        "architecture": ckpt.config["architectures"][0],
    }
    if with_llama_cpp:
        from .llamacpp_peer import open_model

        with open_model(str(path), n_ctx=64, threads=1) as m:
            summary["llama_cpp_n_vocab"] = m.n_vocab
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output", metavar="OUT.gguf", help="file to write (best outside the repository)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument(
        "--type",
        dest="ftype",
        choices=list(LLAMA_FTYPES),
        default="Q4_K_M",
        help="file type; anything but F16 is made by llama.cpp's quantizer",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="keep the shape's widths with this many layers (e.g. a float32 reference that fits memory)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--keep-f16", metavar="PATH", default=None, help="also keep the F16 file it was quantized from, here"
    )


def run(args: argparse.Namespace) -> int:
    out = Path(args.output).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    if args.layers is not None:
        if args.layers < 1:
            raise SystemExit(f"--layers must be at least 1, got {args.layers}")
        shape = dataclasses.replace(shape, layers=args.layers)
    t0 = time.perf_counter()
    if args.ftype in ("F16", "F32"):
        write_random(out, shape, args.seed, args.ftype)
    else:
        keep = Path(args.keep_f16).expanduser() if args.keep_f16 else None
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            f16 = keep or Path(tmp) / "f16.gguf"
            print(f"writing {args.shape} F16 weights to {f16} ...", flush=True)
            write_random(f16, shape, args.seed)
            print(f"quantizing to {args.ftype} with llama.cpp ...", flush=True)
            quantize_with_llama_cpp(f16, out, args.ftype, args.threads)
    summary = check_opens(out, with_llama_cpp=_has_llama_cpp())
    print(
        f"wrote {out} in {time.perf_counter() - t0:.0f} s: {summary['parameters'] / 1e6:.0f}M parameters, "
        f"{summary['bytes'] / 1e6:.0f} MB, tensor types {summary['tensor_types']}; "
        f"opens with pagedllm{' and llama.cpp' if 'llama_cpp_n_vocab' in summary else ''}"
    )
    return 0


def _has_llama_cpp() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None
