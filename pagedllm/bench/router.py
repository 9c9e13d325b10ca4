"""`pagedllm bench router`: what cache-aware routing gains over round robin, in one run.

Two replicas of the model (one core each, `pagedllm serve` processes) behind SGLang's gateway;
--conversations chats of --turns turns each, each turn's prompt the whole history so far (about
--last-turn-tokens tokens at the last turn). With --think-time S each conversation pauses a random
time (exponential, mean S, the same draws for every policy) before its first turn and between an
answer and its next turn, as a user reads and types; with 0 every conversation sends its next turn
as soon as the last answer ends (closed loop: the replicas are saturated, and TTFT then measures
the queue more than the prefill). For each policy (fresh replicas each time, so no cache carries
over) and for one replica alone on the same conversations (the hit rate routing can at best keep):
each replica's prefix-cache hit rate (cached / prompt tokens, from its own /metrics), last-turn
TTFT p50/p99, output tok/s. Medians of --repeats; the runs alternate policies. --json keeps every
request (turn, send time, requests in flight then, TTFT, prompt and cached tokens)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from ..server import replicas as rp
from .common import median_of_runs, percentile, pyplot, save_figure, write_json

# Mean pause before a turn: long enough that round robin, which recomputes most of each history,
# does not saturate two one-core replicas, so TTFT measures prefill and cache rather than a queue.
THINK_TIME_S = 20.0
WORDS = (
    "page block cache token prefix router replica engine memory kernel tensor batch decode prefill "
    "stream latency queue worker policy gateway request answer history turn model layer head value "
    "key query rotary norm weight vector scale shard thread core socket buffer graph step"
).split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="default", help="the model each replica serves (default: SmolLM2)")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--last-turn-tokens", type=int, default=1500, help="history at the last turn (about)")
    p.add_argument("--max-tokens", type=int, default=16, help="answer length per turn")
    p.add_argument(
        "--think-time",
        type=_seconds,
        default=THINK_TIME_S,
        metavar="S",
        help="mean pause (s, exponential) before each turn of a conversation; 0: closed loop, "
        "every turn sent as soon as the last answer ends",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the conversations' words and pauses")
    p.add_argument("--repeats", type=int, default=3, help="runs per policy; medians are reported")
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"], choices=rp.POLICIES)
    p.add_argument(
        "--serve-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="more `pagedllm serve` flags for each replica (last on the line)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    p.add_argument("--plot", default=None, metavar="PATH", help="draw TTFT against turn per policy (matplotlib)")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a pause in seconds, 0 or more (0: closed loop)")
    return value


def pauses(n: int, turns: int, think_time: float, seed: int = 0) -> list[list[float]]:
    """Each conversation's pause before each of its turns: exponential with mean think_time (all
    zero for 0), drawn once so every policy gets the same arrivals."""
    if think_time < 0:
        raise ValueError(f"--think-time {think_time}: give a pause of 0 s or more")
    rng = random.Random(seed + 1)
    return [[rng.expovariate(1 / think_time) if think_time else 0.0 for _ in range(turns)] for _ in range(n)]


def conversations(n: int, turns: int, last_tokens: int, seed: int = 0) -> list[list[str]]:
    """Each conversation's user messages: distinct random words (about one token each), sized so the
    history reaches about last_tokens at the last turn."""
    rng = random.Random(seed)
    per_turn = max(8, last_tokens // turns - 20)
    return [
        [f"Conversation {c}, turn {t}: " + " ".join(rng.choice(WORDS) for _ in range(per_turn)) for t in range(turns)]
        for c in range(n)
    ]


async def _turn(client: Any, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start, ttft, text, usage = time.perf_counter(), None, [], {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(piece)
            usage = ev.get("usage") or usage
    return {
        "ttft": ttft,
        "text": "".join(text),
        "tokens": usage.get("completion_tokens", 0),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


class _Run:
    """What one run's conversations share: the clock, the requests in flight, every request's record."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.in_flight = 0
        self.records: list[dict] = []


async def _conversation(
    client: Any, url: str, model: str, c: int, users: list[str], waits: list[float], max_tokens: int, run: _Run
) -> None:
    messages: list[dict] = []
    for t, (user, wait) in enumerate(zip(users, waits)):
        if wait:
            await asyncio.sleep(wait)
        messages.append({"role": "user", "content": user})
        sent, in_flight = time.perf_counter() - run.start, run.in_flight
        run.in_flight += 1
        try:
            out = await _turn(client, url, model, messages, max_tokens)
        finally:
            run.in_flight -= 1
        messages.append({"role": "assistant", "content": out["text"]})
        run.records.append(
            {
                "conversation": c,
                "turn": t,
                "sent_s": sent,
                "in_flight": in_flight,
                "ttft": out["ttft"] if out["ttft"] is not None else float("nan"),
                "tokens": out["tokens"],
                "prompt_tokens": out["prompt_tokens"],
                "cached_tokens": out["cached_tokens"],
            }
        )


async def _drive(url: str, model: str, convs: list[list[str]], waits: list[list[float]], max_tokens: int) -> dict:
    import httpx

    run = _Run()
    async with httpx.AsyncClient(timeout=600) as client:
        run.start = time.perf_counter()
        await asyncio.gather(
            *(_conversation(client, url, model, c, users, waits[c], max_tokens, run) for c, users in enumerate(convs))
        )
        wall = time.perf_counter() - run.start
    return summarize(run.records, len(convs[0]), wall)


def summarize(records: list[dict], turns: int, wall: float) -> dict:
    """A run's figures from its requests' records: TTFT p50 by turn, the last turn's TTFT p50/p99,
    how many requests were in flight when a last turn was sent and what share of its prompt was
    cached (median), output tok/s over the run's wall time."""
    by_turn = [[r for r in records if r["turn"] == t] for t in range(turns)]
    last = by_turn[-1]
    return {
        "ttft_by_turn": [percentile([r["ttft"] for r in rs], 50) for rs in by_turn],
        "last_ttft_p50": percentile([r["ttft"] for r in last], 50),
        "last_ttft_p99": percentile([r["ttft"] for r in last], 99),
        "last_in_flight_p50": percentile([r["in_flight"] for r in last], 50),
        "last_cached_share_p50": percentile(
            [r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0 for r in last], 50
        ),
        "output_tok_s": sum(r["tokens"] for r in records) / wall,
        "wall_s": wall,
        "requests": records,
    }


def _hit_rate(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        m = {}
        for line in r.read().decode().splitlines():
            name, _, value = line.rpartition(" ")
            if line and not line.startswith("#"):
                m[name] = float(value)
    prompt, cached = m.get("pagedllm_prompt_tokens_total", 0.0), m.get("pagedllm_cached_prompt_tokens_total", 0.0)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0}


def _one(
    args: argparse.Namespace, policy: str | None, convs: list[list[str]], waits: list[list[float]], log_dir: Path
) -> dict:
    """One run: fresh replicas (two behind the gateway with `policy`, or one alone for None)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    n = 1 if policy is None else 2
    serve = [args.model, *args.serve_args]
    shares = rp.split_cores(n)
    reps = [rp.Replica(i, serve, rp.free_port(), shares[i][:1], log_dir) for i in range(n)]
    if policy is None:
        fleet = None
        reps[0].start()
        try:
            rp.wait_healthy(reps[0].url, reps[0].proc, 600)
            res = asyncio.run(_drive(reps[0].url, _model_name(reps[0].url), convs, waits, args.max_tokens))
            res["replicas"] = [_hit_rate(reps[0].url)]
        finally:
            reps[0].proc.terminate()
            reps[0].proc.wait(30)
    else:
        fleet = rp.Fleet(reps, [], "127.0.0.1", rp.free_port(), policy, rp.FaultOptions(), log_dir)
        try:
            fleet.start()
            res = asyncio.run(_drive(fleet.url, _model_name(reps[0].url), convs, waits, args.max_tokens))
            res["replicas"] = [_hit_rate(r.url) for r in reps]
        finally:
            fleet.stop()
    total_p = sum(r["prompt_tokens"] for r in res["replicas"])
    res["hit_rate"] = sum(r["cached_tokens"] for r in res["replicas"]) / total_p if total_p else 0.0
    return res


def _model_name(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def _median(runs: list[dict]) -> dict:
    flat = median_of_runs([{k: v for k, v in r.items() if isinstance(v, (int, float))} for r in runs])
    flat["ttft_by_turn"] = [
        percentile([r["ttft_by_turn"][t] for r in runs], 50) for t in range(len(runs[0]["ttft_by_turn"]))
    ]
    flat["replica_hit_rates"] = [
        percentile([r["replicas"][i]["hit_rate"] for r in runs], 50) for i in range(len(runs[0]["replicas"]))
    ]
    return flat


def run(args: argparse.Namespace) -> int:
    try:
        rp.require_gateway()
    except RuntimeError as e:
        print(f"error: {e}", flush=True)
        return 2
    convs = conversations(args.conversations, args.turns, args.last_turn_tokens, args.seed)
    waits = pauses(args.conversations, args.turns, args.think_time, args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="pagedllm-bench-router-"))
    names = ["single", *args.policies]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(args.repeats):  # policies alternate, so a drift of the machine hits each alike
        for name in names:
            r = _one(args, None if name == "single" else name, convs, waits, log_dir / f"{name}-{rep}")
            runs[name].append(r)
            print(
                f"  run {rep + 1}/{args.repeats} {name:12s} hit rate {r['hit_rate']:.1%}, last-turn TTFT p50 "
                f"{r['last_ttft_p50'] * 1e3:.0f} ms p99 {r['last_ttft_p99'] * 1e3:.0f} ms, "
                f"{r['output_tok_s']:.1f} output tok/s, last turns sent with "
                f"{r['last_in_flight_p50']:.0f} requests in flight (median)",
                flush=True,
            )
    results: dict[str, Any] = {}
    for name in names:
        results[name] = r = _median(runs[name])
        r["runs"] = runs[name]
        print(
            f"{name:12s} hit rate {r['hit_rate']:.1%} (per replica "
            f"{', '.join(f'{h:.1%}' for h in r['replica_hit_rates'])}), last-turn TTFT p50 "
            f"{r['last_ttft_p50'] * 1e3:.0f} ms p99 {r['last_ttft_p99'] * 1e3:.0f} ms, "
            f"{r['output_tok_s']:.1f} output tok/s (median of {len(runs[name])})",
            flush=True,
        )
    if "cache_aware" in results and "round_robin" in results:
        ca, rr, one = results["cache_aware"], results["round_robin"], results["single"]
        results["verdict"] = {
            "hit_rate_vs_single": ca["hit_rate"] / one["hit_rate"] if one["hit_rate"] else None,
            "last_ttft_p50_vs_round_robin": ca["last_ttft_p50"] / rr["last_ttft_p50"],
        }
        v = results["verdict"]
        print(
            f"cache_aware: {v['hit_rate_vs_single']:.0%} of one replica's hit rate (bar >= 90%); last-turn "
            f"TTFT p50 {v['last_ttft_p50_vs_round_robin']:.2f}x round robin's (bar <= 0.5x)",
            flush=True,
        )
    results["setup"] = _setup(args, log_dir)
    if args.json:
        write_json(args.json, results)
    if args.plot:
        _plot(results, args.plot)
    return 0


def _setup(args: argparse.Namespace, log_dir: Path) -> dict:
    return {
        "model": args.model,
        "conversations": args.conversations,
        "turns": args.turns,
        "last_turn_tokens": args.last_turn_tokens,
        "max_tokens": args.max_tokens,
        "think_time_s": args.think_time,
        "seed": args.seed,
        "repeats": args.repeats,
        "replica_cores": 1,
        "logs": str(log_dir),
    }


def _plot(results: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results.items():
        if isinstance(r, dict) and "ttft_by_turn" in r:
            ax.plot(range(1, len(r["ttft_by_turn"]) + 1), [t * 1e3 for t in r["ttft_by_turn"]], marker="o", label=name)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.legend()
    save_figure(fig, path)
