"""Point-to-point latency and bandwidth between two pipeline stages, through the stages' own
link (distributed/p2p.py: a header and a payload per hidden-state message, gloo on the CPU).

    pagedllm bench p2p                       # two ranks on this machine (loopback)
    torchrun --nnodes 2 --node-rank R --master-addr HOST --master-port PORT --nproc-per-node 1 \\
        -m pagedllm bench p2p                # one rank on each of two nodes

Rank 0 sends a message of each size to rank 1, which sends it back (ping-pong); the one-way
time is half the round trip, median over `--iters` after a warm-up. The default sizes are
hidden states a pipeline passes: one decode row of a 0.5B / 1.5B / 70B model in bf16, 32 rows
of a 70B, and prefill chunks. docs/scale-out.md projects pipeline decode rates from these.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path

# 896 x 2, 1536 x 2, 8192 x 2 (one bf16 row), 32 x 8192 x 2, 512 x 8192 x 2, 4096 x 8192 x 2
DEFAULT_SIZES = "1792,3072,16384,524288,8388608,67108864"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="message sizes in bytes, comma-separated")
    p.add_argument("--iters", type=int, default=200, help="round trips per size (fewer for large ones)")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--output", default="bench-results/p2p.json")


def measure(rank: int, sizes: list[int], iters: int) -> list[dict]:
    """Ping-pong between ranks 0 and 1 of the default group; rank 0's rows (rank 1: [])."""
    import torch

    from ..distributed.p2p import StageLink

    peer = 1 - rank
    link = StageLink(rank, prev=peer, next=peer)
    rows = []
    for size in sizes:
        t = torch.ones(size, dtype=torch.uint8)
        n = max(5, min(iters, int(4e9 // max(size, 1) // 100)))
        times = []
        for i in range(n + 3):  # 3 warm-up round trips
            if rank == 0:
                t0 = time.perf_counter()
                link.send(t)
                link.recv()
                if i >= 3:
                    times.append((time.perf_counter() - t0) / 2)
            else:
                link.send(link.recv())
        if rank == 0:
            med = statistics.median(times)
            rows.append(
                {
                    "bytes": size,
                    "iters": n,
                    "one_way_median_us": med * 1e6,
                    "one_way_p90_us": sorted(times)[int(0.9 * (len(times) - 1))] * 1e6,
                    "GBps": size / med / 1e9,
                }
            )
    return rows


def _rank(rank: int, args: argparse.Namespace, init_method: str | None, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        args.backend, rank=rank, world_size=2, init_method=init_method, timeout=timedelta(seconds=60)
    )
    try:
        rows = measure(rank, [int(s) for s in args.sizes.split(",")], args.iters)
        if rank == 0 and out is not None:
            out.put(rows)
        return rows
    finally:
        dist.destroy_process_group()


def _where() -> str:
    """Where the two ranks are, for the record."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return (
            f"torchrun, {os.environ.get('GROUP_WORLD_SIZE', '?')} node(s), master "
            f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        )
    return "two processes on this machine (loopback)"


def run(args: argparse.Namespace) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # under torchrun: this process is one of the two ranks
        if world != 2:
            raise SystemExit(f"bench p2p runs between 2 ranks; torchrun started {world}")
        rank = int(os.environ["RANK"])
        rows = _rank(rank, args, None, None)
        if rank != 0:
            return 0
    else:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init = f"tcp://127.0.0.1:{port}"
        out = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, args, init, out)) for r in range(2)]
        for p in procs:
            p.start()
        rows = out.get()
        for p in procs:
            p.join()
    where = _where()
    print(f"point-to-point (stage link), {args.backend}, {where}, 1 thread each; one-way = half a round trip:")
    for r in rows:
        print(
            f"  {r['bytes']:>9} B: {r['one_way_median_us']:10.1f} us median  "
            f"{r['one_way_p90_us']:10.1f} us p90  {r['GBps']:.3f} GB/s"
        )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(
        json.dumps({"backend": args.backend, "where": where, "host": socket.gethostname(), "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    raise SystemExit(run(ap.parse_args()))
