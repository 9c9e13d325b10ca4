"""`pagedllm bench interleave`: a short stream beside a long prefill, as a coding agent makes
them (a title or a token count beside its 10-20k-token first turn).

Three arms on one engine, each run `--runs` times (medians): the stream alone; the long prompt
alone (its prefill's throughput: prompt tokens over its time to first token); both, the stream
added once the long prompt's prefill has begun, with the scheduler's pacing on
(`--decode-latency-factor`, engine/pacing.py) and, for reference, off. Reported: the stream's
p50 and p99 inter-token latency beside the prefill against alone, and the prefill's throughput
beside the stream against alone. Prefix caching is off, so no arm reuses another's prompt."""

from __future__ import annotations

import argparse
import random
import statistics
import time

from .common import machine_info, percentile, write_json

WORDS = (
    "river mountain engine paper garden window history science music planet market "
    "language winter signal forest harbor bridge ocean theory memory circuit village"
).split()


def _prompt(llm, rng: random.Random, tokens: int) -> list[int]:
    text = " ".join(rng.choice(WORDS) for _ in range(tokens * 2))
    return llm.tokenizer.encode(text)[:tokens]


def _run(llm, long_ids: list[int] | None, short_ids: list[int] | None, stream_tokens: int) -> dict:
    """Step the engine until both requests end; the stream's token times and the long prompt's
    time to its first token."""
    from ..sampling.params import SamplingParams

    eng = llm.engine
    t0 = time.perf_counter()
    long_rid = short_rid = None
    token_times: list[float] = []
    prefill_s = None

    def record(outs: list) -> None:
        nonlocal prefill_s
        now = time.perf_counter()
        for out in outs:
            if out.request_id == short_rid:
                new = len(out.outputs[0].token_ids) - len(token_times)
                token_times.extend([now] * max(new, 0))
            elif out.request_id == long_rid and prefill_s is None and out.outputs[0].token_ids:
                prefill_s = now - t0

    if long_ids is not None:
        long_rid = eng.add_request(long_ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        if short_ids is not None:
            record(eng.step())  # the prefill has begun when the stream comes
    t_short = time.perf_counter()
    if short_ids is not None:
        short_rid = eng.add_request(
            short_ids, SamplingParams(max_tokens=stream_tokens, temperature=0.0, ignore_eos=True)
        )
    while eng.has_unfinished():
        record(eng.step())
    itl = [b - a for a, b in zip(token_times, token_times[1:])]
    return {"itl": itl, "prefill_s": prefill_s, "ttft_s": token_times[0] - t_short if token_times else None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--prefill-tokens", type=int, default=8000, help="the long prompt's tokens")
    p.add_argument("--stream-prompt-tokens", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=64, help="tokens the short stream decodes")
    p.add_argument(
        "--decode-latency-factor",
        type=float,
        default=2.5,
        help="the pacing measured (engine/pacing.py); the reference arm runs without",
    )
    p.add_argument("--runs", type=int, default=3, help="repeat each arm and report medians")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="bench-results/interleave.json")


def run(args: argparse.Namespace) -> dict:
    from .. import LLM
    from ..engine.pacing import PrefillPacer

    llm = LLM(
        args.model,
        dtype=args.dtype,
        enable_prefix_caching=False,
        max_model_len=args.prefill_tokens + args.stream_prompt_tokens + args.stream_tokens + 64,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_latency_factor=args.decode_latency_factor,
    )
    sched = llm.engine.scheduler
    rng = random.Random(args.seed)
    _run(llm, _prompt(llm, rng, 256), _prompt(llm, rng, 32), 8)  # warm-up: kernels, allocator

    def arm(long: bool, short: bool, factor: float) -> dict:
        sched.pacer = PrefillPacer(factor) if factor else None  # fresh costs for each run
        return _run(
            llm,
            _prompt(llm, rng, args.prefill_tokens) if long else None,
            _prompt(llm, rng, args.stream_prompt_tokens) if short else None,
            args.stream_tokens,
        )

    rows = {"stream alone": [], "prefill alone": [], "together, paced": [], "together, not paced": []}
    for _ in range(args.runs):  # the arms alternate, so drift on a shared machine hits all alike
        rows["stream alone"].append(arm(False, True, args.decode_latency_factor))
        rows["prefill alone"].append(arm(True, False, args.decode_latency_factor))
        rows["together, paced"].append(arm(True, True, args.decode_latency_factor))
        rows["together, not paced"].append(arm(True, True, 0.0))

    result = {"machine": machine_info(), "args": vars(args), **_table(args, rows)}
    path = write_json(args.output, result)
    print(f"results written to {path}")
    return result


def _table(args: argparse.Namespace, rows: dict[str, list[dict]]) -> dict:
    """Each arm's medians (TTFT, inter-token latency, prefill rate), each against alone; printed."""

    def itl(name: str, q: float) -> float:
        return statistics.median(percentile(r["itl"], q) for r in rows[name])

    def prefill_tps(name: str) -> float:
        return statistics.median(args.prefill_tokens / r["prefill_s"] for r in rows[name])

    result: dict = {}
    alone_p99 = itl("stream alone", 99)
    print(
        f"{args.model}: a {args.stream_tokens}-token stream beside a {args.prefill_tokens}-token prefill, "
        f"medians of {args.runs} runs"
    )
    print(
        f"{'arm':24} {'TTFT s':>7} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'p99 / alone':>12} "
        f"{'prefill tok/s':>14} {'/ alone':>8}"
    )
    base_tps = prefill_tps("prefill alone")
    for name in rows:
        line = {"arm": name}
        if name != "prefill alone":
            line.update(
                ttft_s=statistics.median(r["ttft_s"] for r in rows[name]),
                itl_p50_ms=itl(name, 50) * 1e3,
                itl_p99_ms=itl(name, 99) * 1e3,
                itl_p99_vs_alone=itl(name, 99) / alone_p99,
            )
        if name != "stream alone":
            line.update(prefill_tok_s=prefill_tps(name), prefill_vs_alone=prefill_tps(name) / base_tps)
        result[name] = line
        print(
            f"{name:24} {line.get('ttft_s', float('nan')):7.2f} {line.get('itl_p50_ms', float('nan')):11.1f} {line.get('itl_p99_ms', float('nan')):11.1f} "
            f"{line.get('itl_p99_vs_alone', float('nan')):11.2f}x {line.get('prefill_tok_s', float('nan')):14.1f} "
            f"{line.get('prefill_vs_alone', float('nan')):7.2f}x"
        )
    return result
