"""`pagedllm bench serve`: concurrent streaming clients against a running `pagedllm serve`.

Each client loops for the whole duration: one streamed chat completion at a
time, timing the first content token and the whole answer. The report gives
requests/s, TTFT and latency percentiles, token throughput, errors, and the
server's resident memory (from its /metrics) at start and end. With `--spawn`
the server is started here, in its own process, and stopped at the end.
`--concurrency 1,4,16` runs one load per level in turn, and `--plot PATH` draws
output throughput against concurrency and the TTFT and inter-token latency
distributions of each level (matplotlib, the `plot` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .common import percentile, pyplot, save_figure, wait_ready

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for sleeping better.",
    "Explain what a hash table is.",
    "Name three planets of the solar system.",
    "Translate 'good morning' into Spanish.",
    "What is 17 times 3?",
    "Describe a cat in one sentence.",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument(
        "--concurrency",
        type=_levels,
        default=[16],
        metavar="N[,N...]",
        help="streaming clients at once; a comma list runs one load per level, in turn",
    )
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--spawn", action="store_true", help="start `pagedllm serve` here (flags after --server-args) and stop it after"
    )
    p.add_argument(
        "--server-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="with --spawn: arguments for `pagedllm serve` (must come last)",
    )
    p.add_argument("--output", default=None, help="also write the report as JSON here")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="draw output tok/s against concurrency and the TTFT and inter-token latency "
        "distributions as a PNG (matplotlib: pip install 'pagedllm[plot]')",
    )
    p.add_argument(
        "--response-format",
        default=None,
        type=_json_arg,
        help="an OpenAI response_format for every request (JSON text, or @FILE): "
        "measures structured output against the same load without it",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="every answer runs to its max_tokens (equal lengths for comparisons)"
    )
    _against_throughput_arguments(
        p.add_argument_group("--against-throughput: the server against the offline engine on one workload")
    )


def _against_throughput_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--against-throughput",
        action="store_true",
        help="run a fixed workload through the offline engine (as `bench throughput`) and "
        "through a spawned `pagedllm serve` (both built from --server-args), interleaved, "
        "and report both and their ratio (pagedllm/bench/serve_offline.py)",
    )
    g.add_argument("--num-requests", type=int, default=64)
    g.add_argument("--min-prompt", type=int, default=128, help="prompt tokens, at least")
    g.add_argument("--max-prompt", type=int, default=256)
    g.add_argument("--min-output", type=int, default=64, help="output tokens (EOS ignored), at least")
    g.add_argument("--max-output", type=int, default=128)
    g.add_argument(
        "--request-rates",
        default="inf,4",
        metavar="RATES",
        help="comma-separated arrival rates: inf (all at once) or requests a second (Poisson)",
    )
    g.add_argument("--runs", type=int, default=3, help="repeat and report medians")
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch threads of each side (OMP_NUM_THREADS for the server); default: torch's "
        "(one per core). On a machine busy with other work, 1 keeps a step from waiting on its "
        "own descheduled threads",
    )


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a number of clients, or a comma list such as 1,4,16"
        ) from None
    if any(n < 1 for n in levels):
        raise argparse.ArgumentTypeError(f"{text!r}: every level needs at least one client")
    return levels


def _json_arg(text: str) -> dict:
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


@dataclass
class Result:
    ok: bool
    ttft: float | None = None
    latency: float = 0.0
    tokens: int = 0
    error: str | None = None


@dataclass
class Report:
    duration_s: float
    concurrency: int
    requests: int
    errors: int
    requests_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    latency_p50_s: float | None
    latency_p99_s: float | None
    output_tokens: int
    output_tokens_per_s: float
    server_rss_start_mb: float | None
    server_rss_end_mb: float | None
    kv_blocks_used_after: float | None
    error_samples: list[str] = field(default_factory=list)
    # per request, for --plot and the JSON: seconds to the first token, and the mean seconds
    # between the following tokens (a request of one token has none)
    ttft_samples_s: list[float] = field(default_factory=list)
    itl_samples_s: list[float] = field(default_factory=list)


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


async def _metrics(client: Any, url: str) -> dict[str, float]:
    try:
        r = await client.get(f"{url}/metrics", timeout=10)
        return parse_metrics(r.text) if r.status_code == 200 else {}
    except Exception:
        return {}


async def _one(client: Any, url: str, body: dict, timeout: float) -> Result:
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:200]
                return Result(False, error=f"HTTP {r.status_code}: {text}")
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Result(False, error=str(chunk["error"])[:200])
                for ch in chunk.get("choices", []):
                    if ch.get("delta", {}).get("content"):
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
            if not done:
                return Result(False, error="stream ended without [DONE]")
    except Exception as e:  # a load test counts failures, it does not stop on them
        return Result(False, error=f"{type(e).__name__}: {e}"[:200])
    return Result(True, ttft, time.perf_counter() - t0, tokens)


async def _client(
    client: Any, args: argparse.Namespace, deadline: float, rng: random.Random, results: list[Result]
) -> None:
    while time.perf_counter() < deadline:
        body = {
            "model": args.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": rng.randint(args.min_tokens, args.max_tokens),
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
        }
        if args.response_format is not None:
            body["response_format"] = args.response_format
        results.append(await _one(client, args.url, body, args.timeout))


async def _run(args: argparse.Namespace, concurrency: int) -> Report:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(headers=headers, limits=limits) as client:
        if args.model is None:
            r = await client.get(f"{args.url}/v1/models", timeout=30)
            args.model = r.json()["data"][0]["id"]
        before = await _metrics(client, args.url)
        results: list[Result] = []
        t0 = time.perf_counter()
        deadline = t0 + args.duration
        await asyncio.gather(
            *[_client(client, args, deadline, random.Random(args.seed + i), results) for i in range(concurrency)]
        )
        elapsed = time.perf_counter() - t0
        await asyncio.sleep(0.5)  # let the engine thread publish its idle state
        after = await _metrics(client, args.url)
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    rss = "process_resident_memory_bytes"
    return Report(
        duration_s=elapsed,
        concurrency=concurrency,
        requests=len(ok),
        errors=len(results) - len(ok),
        requests_per_s=len(ok) / elapsed,
        ttft_p50_s=percentile(ttfts, 50, None),
        ttft_p99_s=percentile(ttfts, 99, None),
        latency_p50_s=percentile([r.latency for r in ok], 50, None),
        latency_p99_s=percentile([r.latency for r in ok], 99, None),
        output_tokens=sum(r.tokens for r in ok),
        output_tokens_per_s=sum(r.tokens for r in ok) / elapsed,
        server_rss_start_mb=before[rss] / 2**20 if rss in before else None,
        server_rss_end_mb=after[rss] / 2**20 if rss in after else None,
        kv_blocks_used_after=after.get("pagedllm_kv_blocks_used"),
        error_samples=sorted({r.error for r in results if r.error})[:5],
        ttft_samples_s=ttfts,
        itl_samples_s=[(r.latency - r.ttft) / (r.tokens - 1) for r in ok if r.ttft is not None and r.tokens > 1],
    )


def format_report(r: Report) -> str:
    def f(x: float | None, unit: str = "s") -> str:
        return "n/a" if x is None else f"{x:.3f} {unit}"

    lines = [
        f"{r.requests} requests in {r.duration_s:.1f} s with {r.concurrency} streaming clients: "
        f"{r.requests_per_s:.2f} req/s, {r.output_tokens_per_s:.1f} output tok/s, {r.errors} errors",
        f"TTFT p50 {f(r.ttft_p50_s)}, p99 {f(r.ttft_p99_s)}; "
        f"latency p50 {f(r.latency_p50_s)}, p99 {f(r.latency_p99_s)}",
        f"server memory (RSS): start {f(r.server_rss_start_mb, 'MB')}, end {f(r.server_rss_end_mb, 'MB')}; "
        f"KV blocks in use after the run: {r.kv_blocks_used_after}",
    ]
    if r.error_samples:
        lines.append("errors: " + " | ".join(r.error_samples))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.against_throughput:
        from .serve_offline import run as run_against

        return run_against(args)
    try:
        import httpx  # noqa: F401
    except ImportError:
        print("error: the load test needs httpx (pip install httpx)", file=sys.stderr)
        return 2
    if args.plot and pyplot() is None:
        return 2
    proc = None
    if args.spawn:
        cmd = [sys.executable, "-m", "pagedllm.cli.main", "serve", *args.server_args]
        print("starting:", " ".join(cmd), file=sys.stderr, flush=True)
        proc = subprocess.Popen(cmd)
    try:
        if proc is not None:
            wait_ready(args.url, proc)
        reports = []
        for level in args.concurrency:
            reports.append(asyncio.run(_run(args, level)))
            print(format_report(reports[-1]), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        data = [asdict(r) for r in reports]
        Path(args.output).write_text(json.dumps(data[0] if len(data) == 1 else data, indent=2))
    if args.plot:
        plot(reports, args.plot, title=f"pagedllm bench serve, {args.model}")
    return 0 if all(r.errors == 0 for r in reports) else 1


def plot(reports: list[Report], path: str, title: str = "") -> None:
    """Output tok/s against concurrency (left), and each level's TTFT and inter-token latency
    as cumulative distributions (middle, right)."""
    plt = pyplot()
    if plt is None:
        return
    fig, (ax_tp, ax_ttft, ax_itl) = plt.subplots(1, 3, figsize=(13, 3.8))
    levels = [r.concurrency for r in reports]
    ax_tp.plot(levels, [r.output_tokens_per_s for r in reports], marker="o", label="output tok/s")
    ax_tp.set_xscale("log", base=2)
    ax_tp.set_xticks(levels, [str(n) for n in levels])
    ax_tp.set_xlabel("streaming clients at once")
    ax_tp.set_ylabel("output tokens / s")
    ax_tp.set_title("throughput")
    for r in reports:
        for ax, xs, scale in ((ax_ttft, r.ttft_samples_s, 1.0), (ax_itl, r.itl_samples_s, 1e3)):
            xs = sorted(x * scale for x in xs)
            if xs:
                ax.plot(
                    xs,
                    [(i + 1) / len(xs) for i in range(len(xs))],
                    drawstyle="steps-post",
                    marker=".",
                    label=f"{r.concurrency} client{'s' if r.concurrency > 1 else ''}",
                )
    ax_ttft.set_xlabel("time to first token (s)")
    ax_itl.set_xlabel("inter-token latency, mean per request (ms)")
    for ax, name in ((ax_ttft, "TTFT"), (ax_itl, "inter-token latency")):
        ax.set_ylabel("share of requests")
        ax.set_title(name)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    save_figure(fig, path)
