"""Rank 0's side of tensor parallelism: start the other ranks, send each step, stop them.

One machine: `TPExecutor.start` spawns size - 1 worker processes (executor.py's `spawn`) and
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
import time
from typing import Iterator

import torch
import torch.distributed as dist

from . import messages
from .executor import Executor, torchrun_rank, torchrun_world
from .group import TPInfo, init_groups
from .worker import WorkerSpec, rank_device, worker_main

logger = logging.getLogger(__name__)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed; the engine cannot go on (make a new LLM)."""


class TPExecutor(Executor):
    kind = "tensor-parallel worker"
    size_arg = "tensor_parallel_size"
    error = TensorParallelError

    # -- start ---------------------------------------------------------------------------
    @classmethod
    def start(cls, size: int, spec: WorkerSpec) -> "TPExecutor":
        """Rank 0 of a new group: torchrun's, when the environment names one, else spawned
        workers on this machine."""
        cls.check_alone()
        world = torchrun_world()
        if world > 1:  # torchrun: the other ranks are already running the same script
            if world != size:
                raise ValueError(f"tensor_parallel_size={size} but torchrun started {world} ranks")
            ex = cls(TPInfo(torchrun_rank(), size), size, [], [], None)
            init_groups(ex.info, rank_device(spec.device, ex.info.rank), None)
            return ex
        logger.info("tensor parallel: %d ranks on this machine, %d thread(s) each", size, spec.threads)
        ex = cls(TPInfo(0, size), size, [], [], None)
        init_method = ex.spawn(worker_main, lambda rank, init: (rank, size, init, spec), spec.threads, "pagedllm-tp")
        try:
            init_groups(ex.info, rank_device(spec.device, 0), init_method)
        except BaseException:
            ex.shutdown()
            raise
        return ex

    def load_args(self) -> dict:
        """What load_model takes to load this rank's part: its shard."""
        return {"tp": self.info}

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
            messages.send(self.info.control, messages.SETUP, [[num_blocks]])

    # -- steps -----------------------------------------------------------------------------
    def recorded(self, backend, copy_fn):
        """The backend and copy function the engine uses: each cache operation runs here and is
        queued for the other ranks, which apply it before the next step's forward."""
        copy = self.recorded_copy(copy_fn)
        if backend.uses_block_tables:  # paged: forks share blocks, frees are the block manager's
            return backend, copy
        return _RecordingBackend(backend, self.ops), copy

    def forward(self, plan, runner):
        """Send the plan, then run it on `runner` (the engine's ModelRunner over rank 0's shard):
        (logits, kept hidden rows), as ModelRunner.forward gives them."""
        with self.guard():  # a failed rank fails the step with a clear error
            self.send_step(plan)
            return runner.forward(plan)

    def trace_fields(self) -> dict:
        """The KV trace's per-rank figures (kv/trace.py)."""
        return dict(
            tensor_parallel_size=self.info.size,
            rank_weight_mb=[w / 2**20 for w, _ in self.rank_bytes],
            rank_kv_mb=[kv / 2**20 for _, kv in self.rank_bytes],
            allreduce_bytes_per_step=self.info.reduced_bytes / max(1, self.steps),
        )

    def send_step(self, plan) -> None:
        if self.dead:
            raise TensorParallelError(self.dead)
        self.message_bytes += messages.send(self.info.control, messages.STEP, messages.step_lists(plan, self.ops))
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
        ended = self.ended_ranks()
        who = "; ".join(ended) if ended else "no worker process has exited (a stuck or remote rank)"
        return (
            f"tensor-parallel engine stopped: a collective failed ({who}): "
            f"{str(err).splitlines()[0] if str(err) else type(err).__name__}. The requests in "
            "flight failed; create a new LLM to go on"
        )


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
