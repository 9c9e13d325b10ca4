"""All-reduce latency and bandwidth with torch.distributed (gloo on the CPU by default), at the
sizes a tensor-parallel step sends: one hidden-state row per token, per all-reduce.

    pagedllm bench allreduce --ranks 2 --sizes 2304,16384,65536,1048576,8388608

Each figure is the median over `--iters` calls after a warm-up, in processes started here
(one thread each). docs/scale-out.md projects decode step times from these.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta

DEFAULT_SIZES = "2304,8192,16384,65536,262144,1048576,8388608"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="message sizes in bytes, comma-separated")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--output", default="bench-results/allreduce.json")


def _rank(rank: int, args: argparse.Namespace, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        args.backend,
        rank=rank,
        world_size=args.ranks,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=timedelta(seconds=60),
    )
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        t = torch.ones(max(1, size // 4), dtype=torch.float32)
        iters = max(10, min(args.iters, int(2e9 // max(size, 1) // 50)))
        for _ in range(5):
            dist.all_reduce(t)
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        rows.append({"bytes": size, "iters": iters, "median_us": med * 1e6, "algbw_GBps": size / med / 1e9})
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    import torch.multiprocessing as mp

    from ..distributed.executor import free_port as _free_port

    ctx = mp.get_context("spawn")
    port, out = _free_port(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, port, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows = out.get()
    for p in procs:
        p.join()
    print(f"all-reduce, {args.backend}, {args.ranks} ranks on this machine (loopback), 1 thread each:")
    for r in rows:
        print(f"  {r['bytes']:>9} B: {r['median_us']:9.1f} us  {r['algbw_GBps']:.3f} GB/s")
    from pathlib import Path

    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"backend": args.backend, "ranks": args.ranks, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    raise SystemExit(run(ap.parse_args()))
