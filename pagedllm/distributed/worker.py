"""A tensor-parallel rank other than 0: load its shard, build its cache, run what rank 0 sends.

It owns no scheduler, tokenizer state or sampler: each step's plan arrives whole from rank 0
(distributed/messages.py); the forward's all-reduces and the logits gather pair it with the
other ranks. It exits when rank 0 says STOP, when a collective fails (a peer died: the
sockets close), or when its parent process dies (Linux: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass

import torch

from . import messages
from .group import TPInfo, destroy_groups, init_groups

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """What a worker needs to build the same engine side as rank 0 (picklable)."""

    source: object  # a loading.source.ModelSource
    dtype: torch.dtype
    device: str  # "cpu", or "cuda" (rank r uses cuda:r)
    max_positions: int | None
    dequantize_weights: bool
    isq: str | None
    cache_cfg: object  # a config.CacheConfig
    threads: int
    log_level: int = logging.WARNING
    max_rank_memory_mb: float | None = None  # a rank's weights above it are refused (loader.check_rank_memory)


def rank_device(device: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device == "cuda" else torch.device(device)


def worker_main(rank: int, size: int, init_method: str | None, spec: WorkerSpec, conn=None) -> None:
    """The worker process's entry (torch.multiprocessing spawn, or a torchrun rank > 0).
    `conn`: a pipe to rank 0 for "loaded" / an error text (never tensors)."""
    _die_with_parent()
    if conn is not None:
        _leave_stops_to_rank0()
        conn.send(("started", os.getpid()))
    logging.basicConfig(level=spec.log_level, format=f"[tp rank {rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(spec.threads)
    tp = TPInfo(rank, size)
    code = 0
    try:
        serve(tp, init_method, spec, conn)
    except BaseException as e:  # report, then exit non-zero: rank 0's collectives fail at once
        code = 1
        logger.error("worker failed: %s: %s", type(e).__name__, e)
        if conn is not None:
            try:
                conn.send(("error", f"{type(e).__name__}: {e}"))
            except Exception:
                pass
    finally:
        destroy_groups(tp)
    sys.exit(code)


def serve(tp: TPInfo, init_method: str | None, spec: WorkerSpec, conn=None) -> None:
    from ..attention.build import build_kv
    from ..kv.spec import kv_spec_of
    from ..engine.model_runner import ModelRunner
    from ..loading.loader import check_rank_memory, load_model

    device = rank_device(spec.device, tp.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_groups(tp, device, init_method)
    loaded = load_model(
        spec.source,
        spec.dtype,
        device,
        max_positions=spec.max_positions,
        dequantize_weights=spec.dequantize_weights,
        isq=spec.isq,
        tp=tp,
    )
    check_rank_memory(loaded.weight_bytes, spec.max_rank_memory_mb, tp.rank, 1, tp.size)
    if conn is not None:
        conn.send(("loaded", loaded.weight_bytes))
    command, lists = messages.recv(tp.control)
    if command == messages.STOP:
        return
    if command != messages.SETUP:
        raise RuntimeError(f"expected the setup message from rank 0, got command {command}")
    num_blocks = lists[0][0]
    kv_spec = kv_spec_of(loaded, spec.cache_cfg, spec.dtype)
    kv_cache, backend, copy_fn = build_kv(loaded, kv_spec, spec.cache_cfg, num_blocks, device, spec.dtype)
    kv_bytes = kv_cache.nbytes if kv_cache is not None else 0
    sizes = torch.tensor([loaded.weight_bytes, kv_bytes], dtype=torch.int64)
    torch.distributed.gather(sizes, None, dst=0, group=tp.control)
    runner = ModelRunner(loaded.model, backend, spec.cache_cfg.block_size, device, sampler=None)
    apply = {
        messages.OP_COPY_PREFIX: copy_fn,
        messages.OP_FREE_SEQ: lambda a, b, c: backend.free_seq(a),
        messages.OP_FORK_SEQ: lambda a, b, c: backend.fork_seq(a, b),
    }
    while True:
        command, lists = messages.recv(tp.control)
        if command == messages.STOP:
            return
        plan, ops = messages.step_from_lists(lists)
        for i in range(0, len(ops), 4):
            apply[ops[i]](*ops[i + 1 : i + 4])
        runner.logits(plan)


def _leave_stops_to_rank0() -> None:
    """A rank that rank 0 spawned ignores SIGINT and SIGTERM sent to the whole process group (a
    terminal's Ctrl-C, `kill -- -PGID`, a service manager stopping the group): rank 0 stops it
    in its own shutdown, after the requests in flight, and the kernel kills it if rank 0 dies
    (`_die_with_parent`). Otherwise it would die mid-step, and rank 0's orderly stop would
    meet closed sockets and report a failed rank."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when its parent dies, however it died."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the call
            os._exit(1)
    except Exception:
        pass
