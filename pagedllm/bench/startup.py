"""`pagedllm bench startup`: time from starting `pagedllm generate` to its first token.

Each run is a fresh process (the cost a user pays for every one-shot command): the clock
starts just before the process is spawned and stops when the first byte of the answer
arrives on its stdout (the "loading ..." line goes to stderr). Reports the median, and the
CPU seconds the whole process used, which a busy machine disturbs less than the wall time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--runs", type=int, default=5, help="processes to start (default 5)")
    p.add_argument("--prompt", default="Why is the sky blue?")
    p.add_argument("--extra", default="", help="more flags for `generate`, as one string")


def time_to_first_token(model: str, prompt: str, extra: list[str]) -> tuple[float, float, float]:
    """(seconds to the first stdout byte, seconds to exit, CPU seconds) of one `pagedllm generate`."""
    cmd = [sys.executable, "-m", "pagedllm.cli.main", "generate", prompt, "-m", model,
           "--max-tokens", "8", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=os.environ.copy())
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    t_first = time.perf_counter() - t0
    proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = rc = os.waitstatus_to_exitcode(status)
    if rc != 0 or not first:
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {rc}")
    return t_first, time.perf_counter() - t0, usage.ru_utime + usage.ru_stime


def run(args: argparse.Namespace) -> int:
    extra = args.extra.split() if args.extra else []
    firsts, totals, cpus = [], [], []
    for i in range(args.runs):
        t_first, t_total, cpu = time_to_first_token(args.model, args.prompt, extra)
        firsts.append(t_first)
        totals.append(t_total)
        cpus.append(cpu)
        print(f"run {i + 1}: first token after {t_first:.2f} s, exit after {t_total:.2f} s, "
              f"{cpu:.2f} CPU s", flush=True)
    print(f"median of {args.runs}: first token {statistics.median(firsts):.2f} s "
          f"(min {min(firsts):.2f}, max {max(firsts):.2f}), exit {statistics.median(totals):.2f} s, "
          f"{statistics.median(cpus):.2f} CPU s")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pagedllm bench startup")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
