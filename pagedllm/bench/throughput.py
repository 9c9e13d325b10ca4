"""`pagedllm bench throughput`: a fixed, seeded offline workload through our engine and,
in the same run, through transformers `generate` in static batches (the peer).

All requests arrive at t=0 (offline serving); every request generates exactly its
output length (EOS ignored) on both sides so the work is identical.

`--sampling realistic` (the default) samples as chat clients ask: a quarter greedy, the rest
temperature 0.7 with top-p, a third of those with repetition/presence/frequency penalties.
`--sampling greedy` is the plain argmax. `--sampling realistic,greedy` runs both on one
engine, interleaved run by run, and reports their ratio. Each line gives the share of the
engine's step time spent in the sampler. The transformers peer always decodes greedily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

import argparse
import gc
import logging
import random
import time

from .common import machine_info, median_of_runs, percentile, write_json
from .workload import Workload, make_workload  # noqa: F401  (make_workload: serve_offline's and the tests')
from .step_profile import planning_report, profile_decode_step

logger = logging.getLogger(__name__)


SAMPLING_MODES = ("realistic", "greedy")


def sampling_params(mode: str, output_lens: list[int], seed: int) -> list:
    """Per request SamplingParams for a sampling mode (see the module doc)."""
    from ..sampling.params import SamplingParams

    if mode == "greedy":
        return [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in output_lens]
    if mode != "realistic":
        raise ValueError(f"unknown sampling mode {mode!r}: choose from {', '.join(SAMPLING_MODES)}")
    rng = random.Random(seed + 1)
    out = []
    for o in output_lens:
        r = rng.random()
        if r < 0.25:
            kw: dict = dict(temperature=0.0)
        else:
            kw = dict(temperature=0.7, top_p=rng.choice([0.9, 0.95]))
            if r >= 0.75:
                kw.update(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=rng.choice([0.0, 0.2]))
        out.append(SamplingParams(max_tokens=o, ignore_eos=True, **kw))
    return out


class _TimedSampler:
    """Wraps the engine's sampler and adds up the time spent in it (synchronised on CUDA)."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds = inner, 0.0

    def __call__(self, logits, meta, **kw):  # kw: the runner's check_finite=
        import torch

        t0 = time.perf_counter()
        out = self.inner(logits, meta, **kw)
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        self.seconds += time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run_pagedllm(llm, wl: Workload, sampling: str = "greedy", seed: int = 0) -> dict:
    params = sampling_params(sampling, wl.output_lens, seed)
    eng = llm.engine
    eng.waste_sum, eng.waste_steps = 0.0, 0  # the trace's waste average covers this run only
    inner = eng.runner.sampler
    timed = eng.runner.sampler = _TimedSampler(inner)
    steps = eng.stats["steps"]
    t0 = time.perf_counter()
    try:
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
    finally:
        eng.runner.sampler = inner
    dt = time.perf_counter() - t0
    n_out = sum(len(o.token_ids) for o in outs)
    ttft = [o.metrics.time_to_first_token for o in outs]
    tpot = [
        (o.metrics.finished_time - o.metrics.first_token_time) / (len(o.token_ids) - 1)
        for o in outs
        if len(o.token_ids) > 1
    ]
    return {
        "elapsed_s": dt,
        "requests_per_s": len(outs) / dt,
        "output_tokens_per_s": n_out / dt,
        "total_tokens_per_s": (n_out + sum(map(len, wl.prompts))) / dt,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_ms": 1000 * percentile(tpot, 50),
        "tpot_p99_ms": 1000 * percentile(tpot, 99),
        "output_tokens": n_out,
        "preemptions": llm.engine.scheduler.num_preemptions,
        "kv_waste_avg": eng.waste_sum / max(1, eng.waste_steps),
        "sampling": sampling,
        "sampling_share": timed.seconds / dt,
        "steps": eng.stats["steps"] - steps,
    }


def load_transformers_peer(model: str, dtype: torch.dtype, device: torch.device):
    """transformers on the device and dtype our engine used, so the two do the same work."""
    import transformers as tf

    from ..loading.source import resolve

    src = resolve(model)
    if src.kind == "gguf":
        model = tf.AutoModelForCausalLM.from_pretrained(src.path.parent, gguf_file=src.path.name, dtype=dtype)
    else:
        model = tf.AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype)
    return model.to(device).eval()


def run_transformers(model, wl: Workload, batch_size: int, pad_id: int) -> dict:
    """Static batches in arrival order, left-padded; each batch runs to its longest output."""
    import torch

    with torch.inference_mode():
        return _run_transformers(model, wl, batch_size, pad_id)


def _run_transformers(model, wl: Workload, batch_size: int, pad_id: int) -> dict:
    import torch

    t0 = time.perf_counter()
    ttft, n_out, probe = [], 0, 0.0
    for s in range(0, len(wl.prompts), batch_size):
        prompts = wl.prompts[s : s + batch_size]
        lens = wl.output_lens[s : s + batch_size]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(model.device), mask.to(model.device)
        new = max(lens)
        b0 = time.perf_counter()
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=pad_id
        )
        first = time.perf_counter() - b0  # a batch's first token costs one prefill
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad_id,
        )
        ttft += [b0 - t0 - probe + first] * len(prompts)
        probe += first
        n_out += sum(lens)
    # The extra 1-token generate per batch only measured TTFT: take its time back out.
    dt = time.perf_counter() - t0 - probe
    return {
        "elapsed_s": dt,
        "requests_per_s": len(wl.prompts) / dt,
        "output_tokens_per_s": n_out / dt,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "output_tokens": n_out,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sampling",
        default="realistic",
        metavar="MODES",
        help="how our engine samples: realistic (a chat mix of greedy, temperature + top-p "
        "and penalties), greedy, or both comma-separated (interleaved, with their ratio)",
    )
    p.add_argument("--runs", type=int, default=1, help="repeat and report medians")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--pa-gpu-mem", type=float, default=None, help="KV cache MB")
    p.add_argument("--pa-blk-size", type=int, default=32)
    p.add_argument("--pa-cache-type", default="auto")
    p.add_argument(
        "--cache-types",
        default=None,
        metavar="LIST",
        help="comma-separated KV cache types (auto,f8e4m3,int8): our engine runs the "
        "workload once per type, in this run; overrides --pa-cache-type",
    )
    p.add_argument("--no-paged-attn", action="store_true")
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N ranks (worker processes on this machine)",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=_sizes,
        default=[1],
        metavar="P[,P...]",
        help="cut the model into P stages of whole layers (stage processes on this machine); "
        "several sizes (1,2) run the workload at each, one engine after the other, with "
        "their ratio",
    )
    p.add_argument("--peer", choices=["transformers", "none"], default="transformers")
    p.add_argument("--peer-batch-size", type=int, default=32)
    p.add_argument(
        "--profile",
        action="store_true",
        help="print a torch profile of one decode step, and the per-step input planning time "
        "at 32 and 256 running sequences",
    )
    p.add_argument("--output", default="bench-results/throughput.json")


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size or a comma-separated list of sizes (1,2)")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be 1 or more")
    return list(dict.fromkeys(sizes))


def run(args: argparse.Namespace) -> dict:
    types = _cache_types(args)
    sizes = args.pipeline_parallel_size
    if len(sizes) > 1 and len(types) > 1:
        raise ValueError("give several KV cache types (--cache-types) or several pipeline sizes (-pp), not both")
    result: dict = {"machine": machine_info(), "args": vars(args)}
    by_type: dict[str, dict] = {}
    modes = _sampling_modes(args)
    runs = [(ct, sizes[0]) for ct in types] if len(types) > 1 else [(types[0], pp) for pp in sizes]
    for ct, pp in runs:
        key = ct if len(types) > 1 else f"pp={pp}"
        llm, wl, by_mode = _run_one_cache_type(args, ct, pp, modes, first=not by_type)
        for mode, r in by_mode.items():
            label = f"pagedllm [{key}]" if len(runs) > 1 else "pagedllm"
            _print(f"{label} ({mode} sampling)", r)
        if len(modes) > 1:
            base = by_mode[modes[-1]]["output_tokens_per_s"]
            print(
                f"ratio {modes[0]} / {modes[-1]} sampling output tokens/s: "
                f"{by_mode[modes[0]]['output_tokens_per_s'] / base:.2f}x"
            )
        ours = dict(by_mode[modes[0]])
        if len(modes) > 1:
            ours["by_sampling"] = by_mode
        by_type[key] = ours
        if args.profile:
            print(profile_decode_step(llm))
        dtype, device = llm.engine.dtype, llm.engine.device
        pad = llm.engine.tokenizer.eos_token_id or 0
        llm.shutdown()  # tensor-parallel workers and pipeline stages stop with it
        stages = llm.engine.executor.stage_stats if pp > 1 else None
        if stages:  # pipeline parallelism: where each rank's time went (the bubble)
            ours["pipeline_stages"] = stages
            print(pipeline_profile(stages))
        del llm  # one engine (and its KV cache) at a time
        gc.collect()
    if args.profile:
        result["planning"] = planning_report(args)
    ours = next(iter(by_type.values()))
    result["pagedllm"] = ours
    _compare_runs(result, by_type, len(sizes) > 1, len(types) > 1)
    if args.peer == "transformers":
        peer = load_transformers_peer(args.model, dtype, device)
        theirs = median_of_runs([run_transformers(peer, wl, args.peer_batch_size, pad) for _ in range(args.runs)])
        _print(f"transformers (static batches of {args.peer_batch_size})", theirs)
        ratio = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
        print(f"ratio pagedllm / transformers output tokens/s: {ratio:.2f}x")
        result.update(transformers=theirs, ratio_output_tokens_per_s=ratio)
    path = write_json(args.output, result)
    print(f"results written to {path}")
    return result


def _compare_runs(result: dict, by_type: dict, by_size: bool, by_cache: bool) -> None:
    """Several pipeline sizes or KV cache types: each one's rate against the first's."""
    base = next(iter(by_type.values()))["output_tokens_per_s"]
    if by_size:
        result["pagedllm_by_pipeline_size"] = by_type
        print(
            "output tok/s by pipeline size: "
            + ", ".join(
                f"{key} {r['output_tokens_per_s']:.1f} ({r['output_tokens_per_s'] / base:.2f}x)"
                for key, r in by_type.items()
            )
        )
    if by_cache:
        result["pagedllm_by_cache_type"] = by_type
        print(
            "output tok/s by KV cache type: "
            + ", ".join(
                f"{ct} {r['output_tokens_per_s']:.1f} ({r['output_tokens_per_s'] / base:.2f}x, {r['kv_blocks']} blocks)"
                for ct, r in by_type.items()
            )
        )


def pipeline_profile(stages: list[dict]) -> str:
    """Each pipeline rank's time over the measured runs (from the first one's first step to the
    last one's last step; the warm-up left out): its own work (a step's tensors, its layers,
    its rows of the head), waiting for another rank (the stage before it; rank 0: the logits,
    and a send or plan still under way), and the rest (rank 0: its engine's scheduling, sampling
    and output; the others: waiting for the next plan); idle is waiting (pipeline.py `_idle`);
    and each kind of step's busy and wait time a step, which shows the stage that kind leaves
    waiting."""
    lines = [
        "pipeline ranks (measured runs): busy = its tensors and layers (and rows of the head); wait = for "
        "another rank's output; rest = rank 0: the engine's scheduling, sampling, output; the others: "
        "waiting for the next plan; idle = wait (rank 0), wait + rest (the others)"
    ]
    for s in stages:
        w = s["window_s"] or 1.0
        lines.append(
            f"  rank {s['rank']} (stage {s['stage']}): {s['steps']} steps over {s['window_s']:.1f} s; "
            f"busy {s['busy_s'] / w:.0%}, wait {s['wait_s'] / w:.0%}, "
            f"rest {1 - (s['busy_s'] + s['wait_s']) / w:.0%}; idle {s['idle_share']:.0%}"
        )
        kinds = (
            ("with prompt tokens", s["prompt_steps"], s["prompt_busy_s"], s["prompt_wait_s"]),
            (
                "decode only",
                s["steps"] - s["prompt_steps"],
                s["busy_s"] - s["prompt_busy_s"],
                s["wait_s"] - s["prompt_wait_s"],
            ),
        )
        lines.append(
            "    a step, "
            + "; ".join(
                f"{name} ({n}): busy {1000 * b / n:.1f} ms, wait {1000 * q / n:.1f} ms" for name, n, b, q in kinds if n
            )
        )
    return "\n".join(lines)


def _cache_types(args: argparse.Namespace) -> list[str]:
    from ..config import normalize_kv_cache_dtype
    from ..kv.quant import get_mode

    raw = args.cache_types.split(",") if args.cache_types else [args.pa_cache_type]
    types = [get_mode(t).name for t in (normalize_kv_cache_dtype(x) for x in raw) if t]
    if not types:
        raise ValueError("--cache-types is empty; give e.g. auto,f8e4m3,int8")
    return list(dict.fromkeys(types))


def _sampling_modes(args: argparse.Namespace) -> list[str]:
    modes = [m.strip() for m in args.sampling.split(",") if m.strip()]
    bad = [m for m in modes if m not in SAMPLING_MODES]
    if not modes or bad:
        raise ValueError(
            f"--sampling {args.sampling!r}: give one or more of {', '.join(SAMPLING_MODES)}, comma-separated"
        )
    return list(dict.fromkeys(modes))


def _run_one_cache_type(args: argparse.Namespace, cache_type: str, pp: int, modes: list[str], first: bool):
    """A fresh engine with this KV cache type and pipeline size: warm up, then the workload `args.runs` times per
    sampling mode, the modes interleaved run by run so load on the machine hits them alike."""
    import torch

    from .. import LLM

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_seqs,
        kv_cache_memory_mb=args.pa_gpu_mem,
        block_size=args.pa_blk_size,
        kv_cache_dtype=cache_type,
        paged_attention=not args.no_paged_attn,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=pp,
    )
    eng = llm.engine
    avoid = set(eng.eos_token_ids)
    wl = make_workload(
        args.num_requests,
        eng.model_config.vocab_size,
        args.seed,
        (args.min_prompt, args.max_prompt),
        (args.min_output, args.max_output),
        avoid,
    )
    if first:
        print(
            f"workload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt}, "
            f"outputs {args.min_output}-{args.max_output} ({wl.num_output_tokens} output tokens), "
            f"seed {args.seed}; dtype {eng.dtype}, {torch.get_num_threads()} threads"
        )
    elif pp > 1 or len(args.pipeline_parallel_size) > 1:  # each pipeline size runs its ranks at their own threads
        print(f"pp={pp}: {torch.get_num_threads()} threads a rank")
    warm = make_workload(4, eng.model_config.vocab_size, 99, (16, 64), (4, 8), avoid)
    for mode in modes:
        run_pagedllm(llm, warm, mode, args.seed)
    if hasattr(eng.executor, "reset_stats"):  # a pipeline's time profile: the measured runs only
        eng.executor.reset_stats()
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.runs):
        for mode in modes:
            runs[mode].append(run_pagedllm(llm, wl, mode, args.seed))
    by_mode = {}
    for mode, rs in runs.items():
        ours = median_of_runs(rs)
        ours.update(
            kv_cache_dtype=cache_type,
            kv_blocks=eng.block_manager.num_usable_blocks,
            kv_capacity_tokens=eng.block_manager.num_usable_blocks * eng.cache_config.block_size,
        )
        by_mode[mode] = ours
    return llm, wl, by_mode


def _print(name: str, r: dict) -> None:
    line = (
        f"{name}: {r['requests_per_s']:.2f} req/s, {r['output_tokens_per_s']:.1f} output tok/s, "
        f"TTFT p50 {r['ttft_p50_s']:.2f} s p99 {r['ttft_p99_s']:.2f} s"
    )
    if "tpot_p50_ms" in r:
        line += f", TPOT p50 {r['tpot_p50_ms']:.1f} ms p99 {r['tpot_p99_ms']:.1f} ms"
    if "kv_waste_avg" in r:
        line += f", KV waste {r['kv_waste_avg']:.1%}"
    if "sampling_share" in r:
        line += f", sampling {r['sampling_share']:.1%} of step time"
    print(line + f" ({r['elapsed_s']:.1f} s)")
