"""A tensor-parallel rank other than 0: load its shard, build its cache, run what rank 0 sends.

It owns no scheduler, tokenizer state or sampler: each step's plan arrives whole from rank 0
(distributed/messages.py); the forward's all-reduces and the logits gather pair it with the
other ranks. It exits when rank 0 says STOP, when a collective fails (a peer died: the
sockets close), or when its parent process dies (Linux: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, NoReturn

import torch

from ..tuning import configure as configure_tuning, current as tuning_now
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
    # rank 0's kernel routes and tuning (pagedllm/tuning.py), which a spawned process would not
    # inherit: they are not in the environment
    tuning: dict = field(default_factory=lambda: asdict(tuning_now()))


def rank_device(device: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device == "cuda" else torch.device(device)


def load_part(spec: WorkerSpec, device: torch.device, **part):
    """A rank's part of the model (`part`: load_model's `tp` shard and pipeline `stage`), as
    rank 0 loads its own."""
    from ..loading.loader import load_model

    return load_model(
        spec.source,
        spec.dtype,
        device,
        max_positions=spec.max_positions,
        dequantize_weights=spec.dequantize_weights,
        isq=spec.isq,
        **part,
    )


def rank_main(label: str, rank: int, spec: WorkerSpec, conn, body: Callable[[], None]) -> NoReturn:
    """A rank's whole life around `body` (a spawned process, or a torchrun rank > 0): it dies
    with its parent and leaves stops to rank 0, logs as "[label rank N]", tells rank 0 it has
    started; a failure is logged and sent to rank 0 (`conn`: the pipe to it; None under
    torchrun), and the process exits non-zero, so rank 0's collectives fail at once."""
    _die_with_parent()
    if conn is not None:
        _leave_stops_to_rank0()
        conn.send(("started", os.getpid()))
    logging.basicConfig(level=spec.log_level, format=f"[{label} rank {rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(spec.threads)
    configure_tuning(**spec.tuning)
    code = 0
    try:
        body()
    except BaseException as e:
        code = 1
        logger.error("%s rank %d failed: %s: %s", label, rank, type(e).__name__, e)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.send(("error", f"{type(e).__name__}: {e}"))
    sys.exit(code)


def worker_main(rank: int, size: int, init_method: str | None, spec: WorkerSpec, conn=None) -> NoReturn:
    """A tensor-parallel worker's process: its shard served until rank 0 says STOP."""
    tp = TPInfo(rank, size)

    def body() -> None:
        try:
            serve(tp, init_method, spec, conn)
        finally:
            destroy_groups(tp)

    rank_main("tp", rank, spec, conn, body)


def serve(tp: TPInfo, init_method: str | None, spec: WorkerSpec, conn=None) -> None:
    from ..attention.build import build_kv
    from ..kv.spec import kv_spec_of
    from ..engine.model_runner import ModelRunner

    device = rank_device(spec.device, tp.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_groups(tp, device, init_method)
    loaded = load_part(spec, device, tp=tp)
    setup = await_setup(loaded.weight_bytes, spec, (tp.rank, 1, tp.size), tp.control, conn)
    if setup is None:
        return
    num_blocks = setup[0]
    kv_spec = kv_spec_of(loaded, spec.cache_cfg, spec.dtype)
    kv_cache, backend, copy_fn = build_kv(loaded, kv_spec, spec.cache_cfg, num_blocks, device, spec.dtype)
    report_sizes(tp.control, loaded.weight_bytes, kv_cache.nbytes if kv_cache is not None else 0)
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


def await_setup(weight_bytes: int, spec: WorkerSpec, place: tuple[int, int, int], control, conn) -> list | None:
    """A rank with its part loaded: check it against the per-rank limit (`place`: its global
    rank, the pipeline and tensor-parallel sizes), tell rank 0, and wait for the setup message
    (its values), or None when rank 0 stops first."""
    from ..loading.loader import check_rank_memory

    check_rank_memory(weight_bytes, spec.max_rank_memory_mb, *place)
    if conn is not None:
        conn.send(("loaded", weight_bytes))
    command, lists = messages.recv(control)
    if command == messages.STOP:
        return None
    if command != messages.SETUP:
        raise RuntimeError(f"expected the setup message from rank 0, got command {command}")
    return lists[0]


def report_sizes(control, weight_bytes: int, kv_bytes: int) -> None:
    """This rank's weight and KV bytes to rank 0 (Executor.gather_sizes)."""
    torch.distributed.gather(torch.tensor([weight_bytes, kv_bytes], dtype=torch.int64), None, dst=0, group=control)


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
