"""Rank 0's side of tensor parallelism: start the other ranks, send each step, stop them.

One machine: `TPExecutor.start` spawns size - 1 worker processes (torch.multiprocessing) and
splits the cores among the ranks. Several machines: every node runs the same command under
torchrun; rank 0 is the engine and the others serve their shard (`LLM` on a rank > 0 runs
`worker.serve` and exits the process when rank 0 stops).

Faults: a collective that fails (a worker killed or out of memory closes its sockets; a stuck
one trips the compute timeout) ends the engine with `TensorParallelError`, naming the worker
and how it ended; the remaining workers are stopped. `shutdown()` (LLM.shutdown, the context
manager, interpreter exit) sends STOP, joins the workers, and kills any that do not exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from typing import Iterator

import torch
import torch.distributed as dist

from .. import settings
from . import messages
from .children import wait_for_ranks
from .group import TPInfo, destroy_groups, init_groups
from .worker import WorkerSpec, rank_device, worker_main

logger = logging.getLogger(__name__)

_live: list["TPExecutor"] = []  # torch.distributed has one default group per process


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed; the engine cannot go on (make a new LLM)."""


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def check_size(size: int, device: torch.device, what: str = "tensor") -> None:
    """`what`: "tensor" or "pipeline" (the option the message names)."""
    name = f"{what}_parallel_size"
    if size < 1:
        raise ValueError(f"{name} must be >= 1, got {size}")
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(
            f"{name}={size} needs {size} GPUs but this machine has "
            f"{torch.cuda.device_count()}; lower it or run several nodes under torchrun"
        )
    if device.type == "mps":
        raise ValueError(
            f"{what} parallelism runs on the CPU (gloo) or CUDA (NCCL); MPS has no "
            "collective backend in torch.distributed"
        )


class TPExecutor:
    def __init__(self, tp: TPInfo, procs: list, conns: list, threads_before: int | None) -> None:
        self.tp = tp
        self.procs, self.conns = procs, conns
        self.threads_before = threads_before
        self.ops: list[int] = []  # cache operations since the last step, sent with it
        self.dead: str | None = None
        self.closed = False
        self.rank_bytes: list[tuple[int, int]] = []  # (weight bytes, KV bytes) per rank
        self.steps = 0
        self.message_bytes = 0

    # -- start ---------------------------------------------------------------------------
    @classmethod
    def start(cls, size: int, spec: WorkerSpec) -> "TPExecutor":
        """Rank 0 of a new group: torchrun's, when the environment names one, else spawned
        workers on this machine."""
        if _live or (dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) == 1):
            raise ValueError(
                "another tensor- or pipeline-parallel LLM is running in this process; call its "
                "shutdown() first (torch.distributed keeps one group per process)"
            )
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:  # torchrun: the other ranks are already running the same script
            if world != size:
                raise ValueError(f"tensor_parallel_size={size} but torchrun started {world} ranks")
            tp = TPInfo(int(os.environ["RANK"]), size)
            init_groups(tp, rank_device(spec.device, tp.rank), None)
            ex = cls(tp, [], [], None)
        else:
            ex = cls._spawn(size, spec)
        _live.append(ex)
        return ex

    @classmethod
    def _spawn(cls, size: int, spec: WorkerSpec) -> "TPExecutor":
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        threads_before = torch.get_num_threads()
        torch.set_num_threads(spec.threads)
        logger.info("tensor parallel: %d ranks on this machine, %d thread(s) each", size, spec.threads)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        procs, conns = [], []
        ex = cls(TPInfo(0, size), procs, conns, threads_before)
        try:
            for rank in range(1, size):
                parent, child = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=worker_main,
                    args=(rank, size, init_method, spec, child),
                    name=f"pagedllm-tp{rank}",
                    daemon=True,
                )
                p.start()
                child.close()
                procs.append(p)
                conns.append(parent)
            ex._wait_for("started", 120)
            init_groups(ex.tp, rank_device(spec.device, 0), init_method)
        except BaseException:
            ex.shutdown()
            raise
        return ex

    def load_args(self) -> dict:
        """What load_model takes to load this rank's part: its shard."""
        return {"tp": self.tp}

    def wait_loaded(self) -> None:
        """Block until every spawned worker has loaded its shard; a worker's error is raised here."""
        self._wait_for("loaded", settings.get("tp_load_timeout_s"))  # (the workers loading their shards)

    def _wait_for(self, what: str, timeout: float) -> None:
        wait_for_ranks(
            self.procs, self.conns, what, timeout, "tensor-parallel worker", "tensor_parallel_size", TensorParallelError
        )

    def kv_spec(self, loaded, cache_cfg, dtype: torch.dtype, groups):
        """What one block of this rank's KV heads costs: the unit of the per-rank KV budget."""
        from ..kv.spec import kv_spec_of

        return kv_spec_of(loaded, cache_cfg, dtype, groups)

    def build_kv(
        self, loaded, kv_spec, cache_cfg, num_blocks: int, device: torch.device, dtype: torch.dtype, groups=None
    ):
        """Rank 0's cache of its KV heads, its backend and copy function (every rank builds the same)."""
        from ..attention.build import build_kv

        return build_kv(loaded, kv_spec, cache_cfg, num_blocks, device, dtype, groups)

    def setup(self, num_blocks: int) -> None:
        """Tell every rank the cache size rank 0 planned (then each builds its cache)."""
        with self.guard():
            messages.send(self.tp.control, messages.SETUP, [[num_blocks]])

    def gather_sizes(self, weight_bytes: int, kv_bytes: int) -> None:
        """Collect every rank's weight and KV bytes (for the trace), given rank 0's own."""
        mine = torch.tensor([weight_bytes, kv_bytes], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.tp.size)]
        with self.guard():
            dist.gather(mine, parts if self.tp.rank == 0 else None, dst=0, group=self.tp.control)
        self.rank_bytes = [tuple(int(x) for x in p.tolist()) for p in parts]

    # -- steps -----------------------------------------------------------------------------
    def recorded(self, backend, copy_fn):
        """The backend and copy function the engine uses: each cache operation runs here and is
        queued for the other ranks, which apply it before the next step's forward."""
        ops = self.ops

        def copy(src: int, dst: int, n: int) -> None:
            ops.extend((messages.OP_COPY_PREFIX, src, dst, n))
            copy_fn(src, dst, n)

        if backend.uses_block_tables:  # paged: forks share blocks, frees are the block manager's
            return backend, copy
        return _RecordingBackend(backend, ops), copy

    def forward(self, plan, runner):
        """Send the plan, then run it on `runner` (the engine's ModelRunner over rank 0's shard):
        (logits, kept hidden rows), as ModelRunner._forward gives them."""
        with self.guard():  # a failed rank fails the step with a clear error
            self.send_step(plan)
            return runner._forward(plan)

    def trace_fields(self) -> dict:
        """The KV trace's per-rank figures (kv/trace.py)."""
        return dict(
            tensor_parallel_size=self.tp.size,
            rank_weight_mb=[w / 2**20 for w, _ in self.rank_bytes],
            rank_kv_mb=[kv / 2**20 for _, kv in self.rank_bytes],
            allreduce_bytes_per_step=self.tp.reduced_bytes / max(1, self.steps),
        )

    def send_step(self, plan) -> None:
        if self.dead:
            raise TensorParallelError(self.dead)
        self.message_bytes += messages.send(self.tp.control, messages.STEP, messages.step_lists(plan, self.ops))
        self.ops.clear()
        self.steps += 1

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a failed collective into a TensorParallelError that says which rank ended how,
        and stop the rest of the group."""
        if self.dead:
            raise TensorParallelError(self.dead)
        try:
            yield
        except TensorParallelError:
            raise
        except (RuntimeError, dist.DistBackendError) as e:
            self.dead = self._diagnose(e)
            logger.error("%s", self.dead)
            self.shutdown()
            raise TensorParallelError(self.dead) from e

    def _diagnose(self, err: BaseException) -> str:
        time.sleep(0.2)  # a killed worker's exit status lands just after its sockets close
        ended = [
            f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
            for r, p in enumerate(self.procs, start=1)
            if not p.is_alive()
        ]
        who = "; ".join(ended) if ended else "no worker process has exited (a stuck or remote rank)"
        return (
            f"tensor-parallel engine stopped: a collective failed ({who}): "
            f"{str(err).splitlines()[0] if str(err) else type(err).__name__}. The requests in "
            "flight failed; create a new LLM to go on"
        )

    # -- stop --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.dead and self.tp.control is not None:
            try:
                messages.send(self.tp.control, messages.STOP)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                logger.warning("tensor-parallel worker %s did not stop; killing it", p.name)
                p.kill()
                p.join(timeout=5)
        for c in self.conns:
            c.close()
        destroy_groups(self.tp)
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
        if self in _live:
            _live.remove(self)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


class _RecordingBackend:
    """A contiguous backend whose per-sequence frees and forks are queued for the other ranks."""

    def __init__(self, inner, ops: list[int]) -> None:
        self._inner, self._ops = inner, ops

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def free_seq(self, seq_id: int) -> None:
        self._ops.extend((messages.OP_FREE_SEQ, seq_id, 0, 0))
        self._inner.free_seq(seq_id)

    def fork_seq(self, parent_id: int, child_id: int) -> None:
        self._ops.extend((messages.OP_FORK_SEQ, parent_id, child_id, 0))
        self._inner.fork_seq(parent_id, child_id)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
