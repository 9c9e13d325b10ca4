"""A serve soak: does resident memory level off, and does the KV working set stay small?

Starts `pagedllm serve` in its own process, drives it with `pagedllm bench serve` (streaming
clients) for `--duration` seconds, and samples the server's /metrics every `--every` seconds:
resident memory, KV blocks in use now, the most ever in use at once, and the distinct blocks
ever handed out (with lazily allocated CPU pools, the blocks whose pages are committed).

    python -m pagedllm.bench.soak --duration 600 --concurrency 16 -- --pa-blk-size 32
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .loadtest import _wait_ready, parse_metrics

FIELDS = {"rss_mb": "process_resident_memory_bytes", "blocks_used": "pagedllm_kv_blocks_used",
          "blocks_peak_used": "pagedllm_kv_blocks_peak_used", "blocks_touched": "pagedllm_kv_blocks_touched",
          "blocks_total": "pagedllm_kv_blocks_total", "tokens": "pagedllm_generation_tokens_total"}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedllm.cli.main", *args]


def _sample(url: str, t0: float) -> dict:
    m = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
    row = {"t_s": round(time.monotonic() - t0, 1)}
    for k, name in FIELDS.items():
        v = m.get(name)
        row[k] = None if v is None else (round(v / 2**20, 1) if k == "rss_mb" else int(v))
    return row


def run(args: argparse.Namespace) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    log = open(args.server_log, "w")
    server = subprocess.Popen(_cli("serve", "--port", str(args.port), *args.server_args),
                              stdout=log, stderr=subprocess.STDOUT)
    rows: list[dict] = []
    try:
        _wait_ready(url, server)
        t0 = time.monotonic()
        rows.append(_sample(url, t0))
        load = subprocess.Popen(_cli("bench", "serve", "--url", url, "--duration", str(args.duration),
                                     "--concurrency", str(args.concurrency), "--max-tokens",
                                     str(args.max_tokens), "--output", args.load_output),
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        while load.poll() is None:
            time.sleep(args.every)
            rows.append(_sample(url, t0))
            print(json.dumps(rows[-1]), flush=True)
        rows.append(_sample(url, t0))
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    half = [r["rss_mb"] for r in rows[len(rows) // 2:]]
    report = {"samples": rows, "rss_mb_loaded": rows[0]["rss_mb"], "rss_mb_end": rows[-1]["rss_mb"],
              "rss_mb_max": max(r["rss_mb"] for r in rows),
              "rss_mb_second_half_range": [min(half), max(half)],
              "blocks_touched": rows[-1]["blocks_touched"], "blocks_peak_used": rows[-1]["blocks_peak_used"],
              "blocks_total": rows[-1]["blocks_total"]}
    if Path(args.load_output).is_file():
        report["load"] = json.loads(Path(args.load_output).read_text())
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--server-log", default="soak-server.log")
    p.add_argument("--load-output", default="soak-load.json")
    p.add_argument("--output", default="soak.json")
    p.add_argument("server_args", nargs="*", help="after --: arguments for `pagedllm serve`")
    args = p.parse_args(argv)
    report = run(args)
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("samples", "load")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
