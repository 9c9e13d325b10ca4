"""`pagedllm bench serve --against-throughput`: one workload through the offline engine (as
`bench throughput` drives it) and through a spawned `pagedllm serve` with streaming OpenAI
clients, interleaved in one run, so the ratio server/offline is what the HTTP path costs.

Both sides are built from the same `--server-args` (the offline engine by the CLI's own
option parser), so they share the model, the KV cache and the scheduler limits. The
workload is `bench throughput`'s: seeded random token-id prompts and output lengths, EOS
ignored, greedy. Each request is sent as a token-id prompt to /v1/completions, so the server
prefills exactly the tokens the offline engine does. Every request rate in
`--request-rates` ("inf": all at once; else a Poisson process of that many requests a
second, the same arrival times on both sides) gives, per side: output tok/s (from the
first arrival to the last token), TTFT (from the request's arrival time) and inter-token
latency (the gaps between successive pieces of text a client receives) p50/p99, and the CPU
seconds each side used: the engine's (the server process, or this one offline) and, on the
server side, the streaming clients', which run on this machine and share its CPUs with the
server (on 2 CPUs that is part of the gap between the sides). Run i uses
seed + i on both sides (a fresh workload, so the prefix cache does not answer run 2 from
run 1); the sides alternate which goes first, and the load average is reported per run.
`--plot PATH` draws both sides' output tok/s, TTFT and inter-token latency per request rate.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from .common import (
    machine_info,
    median_of_runs,
    percentile,
    pyplot,
    save_figure,
    stop_server,
    wait_ready,
    write_json,
)

logger = logging.getLogger(__name__)

SIDES = ("offline", "server")


@dataclass
class Req:
    prompt: list[int]
    max_tokens: int
    arrival: float  # seconds after the start


@dataclass
class Trace:
    """What one request's client saw: when text arrived, and how many tokens it got."""

    arrival: float
    times: list[float] = field(default_factory=list)  # seconds after the start, one per text piece
    tokens: int = 0
    error: str | None = None


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in (p.strip() for p in text.split(",")):
        try:
            r = float(part)
        except ValueError:
            raise ValueError(f"--request-rates {text!r}: {part!r} is not a number or 'inf'") from None
        if not r > 0:
            raise ValueError(f"--request-rates {text!r}: a rate must be above 0 (requests a second), or inf")
        rates.append(r)
    if not rates:
        raise ValueError("--request-rates is empty; give e.g. inf,4")
    return rates


def rate_name(rate: float) -> str:
    return "all-at-once" if math.isinf(rate) else f"poisson-{rate:g}/s"


def make_requests(args: argparse.Namespace, vocab: int, avoid: set[int], seed: int, rate: float) -> list[Req]:
    from .workload import make_workload

    wl = make_workload(
        args.num_requests, vocab, seed, (args.min_prompt, args.max_prompt), (args.min_output, args.max_output), avoid
    )
    rng, t, arrivals = random.Random(seed + 2), 0.0, []
    for _ in wl.prompts:
        arrivals.append(0.0 if math.isinf(rate) else t)
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    return [Req(p, o, a) for p, o, a in zip(wl.prompts, wl.output_lens, arrivals)]


def summarize(traces: list[Trace]) -> dict:
    ok = [t for t in traces if t.error is None and t.times]
    end = max((t.times[-1] for t in ok), default=0.0)
    start = min((t.arrival for t in traces), default=0.0)
    elapsed = max(end - start, 1e-9)
    ttft = [t.times[0] - t.arrival for t in ok]
    itl = [b - a for t in ok for a, b in zip(t.times, t.times[1:])]
    n_out = sum(t.tokens for t in ok)
    return {
        "requests": len(ok),
        "errors": len(traces) - len(ok),
        "output_tokens": n_out,
        "elapsed_s": elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_ms": 1000 * percentile(itl, 50),
        "itl_p99_ms": 1000 * percentile(itl, 99),
    }


# -- the offline side: the engine driven in this process -------------------------------------------


def run_offline(llm: Any, reqs: list[Req], tag: str) -> list[Trace]:
    """The requests through `llm`'s driver, each added at its arrival time (between steps, as
    the server's engine thread adds them); a step's outputs are timed when the step returns."""
    from ..engine.driver import Item
    from ..sampling.params import SamplingParams

    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    traces = [Trace(r.arrival) for r in reqs]
    index = {f"{tag}-{i}": i for i in order}
    arrivals = [
        (
            reqs[i].arrival,
            Item(
                f"{tag}-{i}",
                reqs[i].prompt,
                SamplingParams(max_tokens=reqs[i].max_tokens, temperature=0.0, ignore_eos=True),
            ),
        )
        for i in order
    ]
    for now, outs in llm.driver.paced(arrivals):
        for out in outs:
            i = index.get(out.request_id)
            if i is None:
                continue
            c = out.outputs[0]
            if c.delta_text:
                traces[i].times.append(now)
            if out.finished:
                traces[i].tokens = len(c.token_ids)
                if out.error:
                    traces[i].error = out.error
    return traces


# -- the server side: streaming OpenAI clients against `pagedllm serve` ----------------------------


async def _client(client: Any, model: str, req: Req, t0: float, timeout: float) -> Trace:
    tr = Trace(req.arrival)
    await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
    try:
        stream = await client.completions.create(
            model=model,
            prompt=req.prompt,
            max_tokens=req.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            timeout=timeout,
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                tr.times.append(time.perf_counter() - t0)
            if chunk.usage is not None:
                tr.tokens = chunk.usage.completion_tokens
    except Exception as e:  # counted as an error in the report, not raised
        tr.error = f"{type(e).__name__}: {e}"[:200]
    return tr


async def _run_server(url: str, model: str, reqs: list[Req], timeout: float) -> list[Trace]:
    import httpx
    import openai

    limits = httpx.Limits(max_connections=len(reqs) + 4, max_keepalive_connections=len(reqs) + 4)
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.AsyncClient(limits=limits, timeout=timeout),
    ) as client:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*[_client(client, model, r, t0, timeout) for r in reqs]))


def run_server(url: str, model: str, reqs: list[Req], timeout: float = 600.0) -> list[Trace]:
    return asyncio.run(_run_server(url, model, reqs, timeout))


# -- the whole comparison -----------------------------------------------------------------------------


def _spawn(url: str, server_args: list[str], threads: int | None) -> subprocess.Popen:
    u = urlparse(url)
    if u.hostname is None or u.port is None:
        raise ValueError(f"--url {url!r} must name a host and a port, e.g. http://127.0.0.1:8011")
    extra = [
        a for flag, a in (("--host", u.hostname), ("--port", str(u.port))) if flag not in server_args for a in (flag, a)
    ]
    cmd = [sys.executable, "-m", "pagedllm.cli.main", "serve", *server_args, *extra]
    print("starting:", " ".join(cmd), file=sys.stderr, flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
    return subprocess.Popen(cmd, env=env)


def cpu_seconds(pid: int | None = None) -> float | None:
    """CPU time (user + system) used so far by this process (None) or by process `pid` (read
    from /proc; None where there is no /proc)."""
    if pid is None:
        return time.process_time()
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _with_cpu(result: dict, here: float, server: float | None, proc: subprocess.Popen, side: str) -> dict:
    """The run's CPU seconds: on the offline side this process is the engine; on the server side
    it is the streaming clients, which share this machine's CPUs with the server."""
    used_here = cpu_seconds() - here
    if side == "offline":
        result["engine_cpu_s"] = used_here
    else:
        result["client_cpu_s"] = used_here
        now = cpu_seconds(proc.pid)
        if now is not None and server is not None:
            result["engine_cpu_s"] = now - server
    return result


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _print_row(name: str, r: dict, prefix: str = "  ", file: Any = None) -> None:
    print(
        f"{prefix}{name:8s} {r['output_tokens_per_s']:8.1f} output tok/s  TTFT p50 {r['ttft_p50_s']:.3f} s "
        f"p99 {r['ttft_p99_s']:.3f} s  ITL p50 {r['itl_p50_ms']:.1f} ms p99 {r['itl_p99_ms']:.1f} ms  "
        f"({r['output_tokens']} tokens, {r['requests']} requests, {r['errors']} errors, "
        f"{r['elapsed_s']:.1f} s{_cpu_text(r)})",
        file=file,
        flush=True,
    )


def _cpu_text(r: dict) -> str:
    parts = [
        f"{name} {r[key]:.1f}" for name, key in (("engine", "engine_cpu_s"), ("clients", "client_cpu_s")) if key in r
    ]
    return f"; CPU s: {', '.join(parts)}" if parts else ""


def run(args: argparse.Namespace) -> int:
    try:
        import openai  # noqa: F401
    except ImportError:
        print("error: --against-throughput needs the openai client (pip install openai)", file=sys.stderr)
        return 2

    rates = parse_rates(args.request_rates)
    if getattr(args, "plot", None) and pyplot() is None:
        return 2
    _check_counts(args)
    # A SIGTERM (a timeout, a CI cancel) must still stop the spawned server: run the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if getattr(args, "offline_llm", None) is None:
        raise SystemExit("--against-throughput runs from the CLI: pagedllm bench serve --against-throughput ...")
    llm = args.offline_llm(args.server_args)  # the engine `pagedllm serve` would build (cli/main.py)
    proc = _spawn(args.url, args.server_args, args.threads)
    result: dict = {
        "machine": machine_info(),
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list, type(None)))},
    }
    try:
        wait_ready(args.url, proc)
        import httpx

        model = args.model or httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
        eng = llm.engine
        vocab, avoid = eng.model_config.vocab_size, set(eng.eos_token_ids)
        print(
            f"workload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens, "
            f"outputs {args.min_output}-{args.max_output} (EOS ignored, greedy), seed {args.seed} + run; "
            f"rates {', '.join(map(rate_name, rates))}; {args.runs} run(s), {os.cpu_count()} CPUs, "
            f"{torch_threads()} engine threads a side"
        )
        warm = make_requests(
            argparse.Namespace(num_requests=4, min_prompt=16, max_prompt=32, min_output=4, max_output=8),
            vocab,
            avoid,
            99,
            math.inf,
        )
        run_offline(llm, warm, "warm")
        run_server(args.url, model, warm)
        runs, loads = _measure_sides(args, llm, proc, model, rates, vocab, avoid)
    finally:
        stop_server(proc)
        llm.shutdown()
    result["load_average"] = loads
    errors = _summarise_rates(args, runs, result)
    print("1-minute load average per run (start -> end): " + ", ".join(f"{a:.2f} -> {b:.2f}" for a, b in loads))
    if args.output:
        print(f"results written to {write_json(args.output, result)}")
    if getattr(args, "plot", None):
        plot(result, args.plot)
    return 0 if errors == 0 and all(r["same_tokens"] for r in result["by_rate"].values()) else 1


def _check_counts(args: argparse.Namespace) -> None:
    if args.runs < 1:
        raise ValueError("--runs must be at least 1")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError("--threads must be at least 1")
        import torch

        torch.set_num_threads(args.threads)


def _measure_sides(args, llm, proc, model: str, rates: list[float], vocab: int, avoid: set) -> tuple[dict, list]:
    """Each run, each rate: the same requests through the offline engine and the server, who goes
    first alternating; (per rate, per side, the runs' summaries) and each run's load averages."""
    runs: dict[str, dict[str, list[dict]]] = {rate_name(r): {s: [] for s in SIDES} for r in rates}
    loads = []
    for k in range(args.runs):
        load0 = os.getloadavg()[0]
        for rate in rates:
            reqs = make_requests(args, vocab, avoid, args.seed + k, rate)
            sides = SIDES if k % 2 == 0 else SIDES[::-1]  # alternate who goes first
            for side in sides:
                here, server = cpu_seconds(), cpu_seconds(proc.pid)
                traces = (
                    run_offline(llm, reqs, f"r{k}-{rate_name(rate)}")
                    if side == "offline"
                    else run_server(args.url, model, reqs)
                )
                runs[rate_name(rate)][side].append(_with_cpu(summarize(traces), here, server, proc, side))
                _print_row(
                    side, runs[rate_name(rate)][side][-1], f"run {k + 1} {rate_name(rate)} ", sys.stderr
                )  # as it comes: a loaded machine may not see the end
        loads.append((load0, os.getloadavg()[0]))
        print(
            f"run {k + 1}/{args.runs} done (1-minute load average {loads[-1][0]:.2f} -> {loads[-1][1]:.2f})",
            file=sys.stderr,
            flush=True,
        )
    return runs, loads


def _summarise_rates(args: argparse.Namespace, runs: dict, result: dict) -> int:
    """Each rate's medians and server/offline ratio into `result` (printed); the errors seen."""
    result["by_rate"] = {}
    errors = 0
    for name, by_side in runs.items():
        med = {side: median_of_runs(rs) for side, rs in by_side.items()}
        med["ratio_output_tokens_per_s"] = med["server"]["output_tokens_per_s"] / med["offline"]["output_tokens_per_s"]
        med["same_tokens"] = all(
            a["output_tokens"] == b["output_tokens"] for a, b in zip(by_side["offline"], by_side["server"])
        )
        med["runs"] = by_side
        result["by_rate"][name] = med
        errors += sum(r["errors"] for rs in by_side.values() for r in rs)
        print(f"{name} (medians of {args.runs}):")
        for side in SIDES:
            _print_row(side, med[side])
        print(
            f"  ratio server/offline output tok/s: {med['ratio_output_tokens_per_s']:.2f}x"
            + ("" if med["same_tokens"] else "  (the sides generated different token counts!)")
        )
    return errors


def plot(result: dict, path: str) -> None:
    """Per request rate, the offline engine's bar beside the server's: output tok/s, TTFT p50
    and p99, inter-token latency p50 and p99 (the medians of the runs)."""
    plt = pyplot()
    if plt is None:
        return
    names = list(result["by_rate"])
    panels = (
        ("output tokens / s", [("output_tokens_per_s", 1.0, "")]),
        ("time to first token (s)", [("ttft_p50_s", 1.0, "p50"), ("ttft_p99_s", 1.0, "p99")]),
        ("inter-token latency (ms)", [("itl_p50_ms", 1.0, "p50"), ("itl_p99_ms", 1.0, "p99")]),
    )
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (title, keys) in zip(axes, panels):
        bars = [(side, key, scale, tag) for key, scale, tag in keys for side in SIDES]
        width = 0.8 / len(bars)
        for i, (side, key, scale, tag) in enumerate(bars):
            xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(names))]
            values = [result["by_rate"][n][side][key] * scale for n in names]
            b = ax.bar(
                xs,
                values,
                width,
                label=f"{side} {tag}".strip(),
                hatch="//" if tag == "p99" else None,
                color="tab:blue" if side == "offline" else "tab:orange",
                alpha=1.0 if tag != "p99" else 0.6,
            )
            ax.bar_label(b, fmt="%.3g", fontsize=7)
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title)
        ax.legend(fontsize=7)
    ratios = ", ".join(f"{n} {result['by_rate'][n]['ratio_output_tokens_per_s']:.2f}x" for n in names)
    fig.suptitle(f"pagedllm bench serve --against-throughput: server / offline output tok/s {ratios}", fontsize=10)
    save_figure(fig, path)
