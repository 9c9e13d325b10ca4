"""`pagedllm bench soak`: does resident memory level off under load and come back at idle?

Starts `pagedllm serve` in its own process, sends one request, drives the server with
`pagedllm bench serve` (streaming clients) for `--duration` seconds, then leaves it idle for
`--idle` seconds, sampling its /metrics every `--every` seconds: resident memory, KV blocks in
use now, the most ever in use at once, and the distinct blocks ever handed out. The report gives
RSS at start, after the first request, at its peak and after the idle time, and their ratio
(idle / first request: what the load left behind), with the load's errors.

    pagedllm bench soak --duration 600 --concurrency 16 --server-args --pa-blk-size 32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .common import stop_server, wait_ready
from .loadtest import parse_metrics

FIELDS = {
    "rss_mb": "process_resident_memory_bytes",
    "blocks_used": "pagedllm_kv_blocks_used",
    "blocks_peak_used": "pagedllm_kv_blocks_peak_used",
    "blocks_touched": "pagedllm_kv_blocks_touched",
    "blocks_total": "pagedllm_kv_blocks_total",
    "tokens": "pagedllm_generation_tokens_total",
    "running": "pagedllm_num_requests_running",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--idle", type=float, default=60.0, help="seconds idle after the load")
    p.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--server-log", default="soak-server.log")
    p.add_argument("--load-output", default="soak-load.json")
    p.add_argument("--output", default="soak.json")
    p.add_argument(
        "--server-args", nargs=argparse.REMAINDER, default=[], help="arguments for `pagedllm serve` (must come last)"
    )


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedllm.cli.main", *args]


def _sample(url: str, t0: float, phase: str) -> dict:
    m = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
    row: dict = {"t_s": round(time.monotonic() - t0, 1), "phase": phase}
    for k, name in FIELDS.items():
        v = m.get(name)
        row[k] = None if v is None else (round(v / 2**20, 1) if k == "rss_mb" else int(v))
    return row


def _first_request(url: str, max_tokens: int) -> None:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=300,
        json={"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": max_tokens},
    )
    r.raise_for_status()


def soak(args: argparse.Namespace) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    log = open(args.server_log, "w")
    server = subprocess.Popen(
        _cli("serve", "--port", str(args.port), *args.server_args), stdout=log, stderr=subprocess.STDOUT
    )
    rows: list[dict] = []

    def sample(phase: str) -> dict:
        rows.append(_sample(url, t0, phase))
        print(json.dumps(rows[-1]), flush=True)
        return rows[-1]

    try:
        wait_ready(url, server)
        t0 = time.monotonic()
        start = sample("start")
        _first_request(url, args.max_tokens)
        first = sample("first request")
        load = _start_load(args, url)
        while load.poll() is None:
            time.sleep(args.every)
            sample("load")
        idle_from = time.monotonic()
        while time.monotonic() - idle_from < args.idle:
            time.sleep(min(args.every, max(0.0, args.idle - (time.monotonic() - idle_from))))
            sample("idle")
        idle = rows[-1]
    finally:
        stop_server(server)
        log.close()
    return _report(args, rows, start, first, idle)


def _start_load(args: argparse.Namespace, url: str) -> subprocess.Popen:
    """`pagedllm bench serve` against the server, in a process of its own."""
    load = ["--url", url, "--duration", str(args.duration), "--concurrency", str(args.concurrency)]
    load += ["--max-tokens", str(args.max_tokens), "--output", args.load_output]
    return subprocess.Popen(_cli("bench", "serve", *load), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _report(args: argparse.Namespace, rows: list[dict], start: dict, first: dict, idle: dict) -> dict:
    loaded = [r["rss_mb"] for r in rows if r["phase"] == "load"] or [first["rss_mb"]]
    report = {
        "samples": rows,
        "rss_mb_start": start["rss_mb"],
        "rss_mb_first_request": first["rss_mb"],
        "rss_mb_peak": max(r["rss_mb"] for r in rows),
        "rss_mb_idle": idle["rss_mb"],
        "idle_s": args.idle,
        "idle_over_first_request": round(idle["rss_mb"] / first["rss_mb"], 3),
        "rss_mb_load_range": [min(loaded), max(loaded)],
        "running_at_idle": idle["running"],
        "blocks_used_at_idle": idle["blocks_used"],
        "blocks_touched": idle["blocks_touched"],
        "blocks_peak_used": idle["blocks_peak_used"],
        "blocks_total": idle["blocks_total"],
    }
    if Path(args.load_output).is_file():
        load_report = json.loads(Path(args.load_output).read_text())
        report["load"] = load_report
        report["requests"], report["errors"] = load_report.get("requests"), load_report.get("errors")
    return report


def run(args: argparse.Namespace) -> int:
    report = soak(args)
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("samples", "load")}, indent=1))
    return 0 if not report.get("errors") else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedllm bench soak", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
