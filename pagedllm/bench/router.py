"""`pagedllm bench router`: what cache-aware routing gains over round robin, in one run.

Two replicas of the model (one core each, `pagedllm serve` processes) behind SGLang's gateway;
--conversations chats of --turns turns each, run at once, each turn's prompt the whole history so
far (about --last-turn-tokens tokens at the last turn). For each policy (fresh replicas each time,
so no cache carries over) and for one replica alone on the same conversations (the hit rate
routing can at best keep): each replica's prefix-cache hit rate (cached / prompt tokens, from its
own /metrics), last-turn TTFT p50/p99, output tok/s. Medians of --repeats."""
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

WORDS = ("page block cache token prefix router replica engine memory kernel tensor batch decode prefill "
         "stream latency queue worker policy gateway request answer history turn model layer head value "
         "key query rotary norm weight vector scale shard thread core socket buffer graph step").split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="default", help="the model each replica serves (default: SmolLM2)")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--last-turn-tokens", type=int, default=1500, help="history at the last turn (about)")
    p.add_argument("--max-tokens", type=int, default=16, help="answer length per turn")
    p.add_argument("--repeats", type=int, default=3, help="runs per policy; medians are reported")
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"], choices=rp.POLICIES)
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                   help="more `pagedllm serve` flags for each replica (last on the line)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    p.add_argument("--plot", default=None, metavar="PATH", help="draw TTFT against turn per policy (matplotlib)")


def conversations(n: int, turns: int, last_tokens: int, seed: int = 0) -> list[list[str]]:
    """Each conversation's user messages: distinct random words (about one token each), sized so the
    history reaches about last_tokens at the last turn."""
    rng = random.Random(seed)
    per_turn = max(8, last_tokens // turns - 20)
    return [[f"Conversation {c}, turn {t}: " + " ".join(rng.choice(WORDS) for _ in range(per_turn))
             for t in range(turns)] for c in range(n)]


async def _turn(client: Any, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
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
    return {"ttft": ttft, "text": "".join(text), "tokens": usage.get("completion_tokens", 0)}


async def _conversation(client: Any, url: str, model: str, users: list[str], max_tokens: int,
                        ttfts: list[list[float]], tokens: list[int]) -> None:
    messages: list[dict] = []
    for t, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        out = await _turn(client, url, model, messages, max_tokens)
        messages.append({"role": "assistant", "content": out["text"]})
        ttfts[t].append(out["ttft"] if out["ttft"] is not None else float("nan"))
        tokens.append(out["tokens"])


async def _drive(url: str, model: str, convs: list[list[str]], max_tokens: int) -> dict:
    import httpx

    ttfts: list[list[float]] = [[] for _ in convs[0]]
    tokens: list[int] = []
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(_conversation(client, url, model, users, max_tokens, ttfts, tokens)
                               for users in convs))
        wall = time.perf_counter() - start
    return {"ttft_by_turn": [percentile(ts, 50) for ts in ttfts], "last_ttft_p50": percentile(ttfts[-1], 50),
            "last_ttft_p99": percentile(ttfts[-1], 99), "output_tok_s": sum(tokens) / wall, "wall_s": wall}


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


def _one(args: argparse.Namespace, policy: str | None, convs: list[list[str]], log_dir: Path) -> dict:
    """One run: fresh replicas (two behind the gateway with `policy`, or one alone for None)."""
    n = 1 if policy is None else 2
    serve = [args.model, *args.serve_args]
    shares = rp.split_cores(n)
    reps = [rp.Replica(i, serve, rp.free_port(), shares[i][:1], log_dir) for i in range(n)]
    if policy is None:
        fleet = None
        reps[0].start()
        try:
            rp.wait_healthy(reps[0].url, reps[0].proc, 600)
            res = asyncio.run(_drive(reps[0].url, _model_name(reps[0].url), convs, args.max_tokens))
            res["replicas"] = [_hit_rate(reps[0].url)]
        finally:
            reps[0].proc.terminate()
            reps[0].proc.wait(30)
    else:
        fleet = rp.Fleet(reps, [], "127.0.0.1", rp.free_port(), policy, rp.FaultOptions(), log_dir)
        try:
            fleet.start()
            res = asyncio.run(_drive(fleet.url, _model_name(reps[0].url), convs, args.max_tokens))
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
    flat["ttft_by_turn"] = [percentile([r["ttft_by_turn"][t] for r in runs], 50)
                            for t in range(len(runs[0]["ttft_by_turn"]))]
    flat["replica_hit_rates"] = [percentile([r["replicas"][i]["hit_rate"] for r in runs], 50)
                                 for i in range(len(runs[0]["replicas"]))]
    return flat


def run(args: argparse.Namespace) -> int:
    try:
        rp.require_gateway()
    except RuntimeError as e:
        print(f"error: {e}", flush=True)
        return 2
    convs = conversations(args.conversations, args.turns, args.last_turn_tokens)
    log_dir = Path(tempfile.mkdtemp(prefix="pagedllm-bench-router-"))
    results: dict[str, Any] = {}
    for policy in [None, *args.policies]:
        name = policy or "single"
        runs = [_one(args, policy, convs, log_dir) for _ in range(args.repeats)]
        results[name] = _median(runs)
        r = results[name]
        print(f"{name:12s} hit rate {r['hit_rate']:.1%} (per replica "
              f"{', '.join(f'{h:.1%}' for h in r['replica_hit_rates'])}), last-turn TTFT p50 "
              f"{r['last_ttft_p50'] * 1e3:.0f} ms p99 {r['last_ttft_p99'] * 1e3:.0f} ms, "
              f"{r['output_tok_s']:.1f} output tok/s (median of {len(runs)})", flush=True)
    if "cache_aware" in results and "round_robin" in results:
        ca, rr, one = results["cache_aware"], results["round_robin"], results["single"]
        results["verdict"] = {"hit_rate_vs_single": ca["hit_rate"] / one["hit_rate"] if one["hit_rate"] else None,
                              "last_ttft_p50_vs_round_robin": ca["last_ttft_p50"] / rr["last_ttft_p50"]}
        v = results["verdict"]
        print(f"cache_aware: {v['hit_rate_vs_single']:.0%} of one replica's hit rate (bar >= 90%); last-turn "
              f"TTFT p50 {v['last_ttft_p50_vs_round_robin']:.2f}x round robin's (bar <= 0.5x)", flush=True)
    results["setup"] = {"model": args.model, "conversations": args.conversations, "turns": args.turns,
                        "last_turn_tokens": args.last_turn_tokens, "max_tokens": args.max_tokens,
                        "repeats": args.repeats, "replica_cores": 1, "logs": str(log_dir)}
    if args.json:
        write_json(args.json, results)
    if args.plot:
        _plot(results, args.plot)
    return 0


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
