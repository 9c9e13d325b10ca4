"""Rank 0's side of parallelism, the part every kind shares (`Executor`): where the ranks come
from (spawned on this machine, or torchrun's on several), waiting for them to start and load,
the sizes they report, the cache operations they repeat, and stopping them. Tensor parallelism
(tensor_parallel.py) and pipeline parallelism (pipeline.py) add what they send each step.

The ranks' side is worker.py (a tensor-parallel shard) and stage.py (a pipeline stage); both
run inside `worker.rank_main`, which reports to rank 0 and exits the process when done."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Callable, ClassVar, Iterator

import torch
import torch.distributed as dist

from .. import settings
from . import messages
from .children import wait_for_ranks
from .group import TPInfo, destroy_groups

logger = logging.getLogger(__name__)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def torchrun_world() -> int:
    """The ranks torchrun started (1: not under torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def torchrun_rank() -> int:
    """This process's global rank under torchrun (0 elsewhere)."""
    return int(os.environ.get("RANK", "0")) if torchrun_world() > 1 else 0


def local_ranks(ranks: int) -> int:
    """How many of the `ranks` share this machine's cores: torchrun's local ranks on a node,
    all of them otherwise."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", ranks)) if torchrun_world() > 1 else ranks


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class Executor:
    """Rank 0's group of ranks. A subclass names its ranks for messages (`kind`, `size_arg`),
    the error a failed rank raises (`error`), and what each step sends."""

    kind: ClassVar[str]  # what a rank is called in messages: "tensor-parallel worker"
    size_arg: ClassVar[str]  # the option that makes the ranks: "tensor_parallel_size"
    error: ClassVar[type[Exception]]
    micro_batches = 1  # steps the engine keeps in flight at once (a pipeline: one a stage)

    def __init__(self, info: TPInfo, world: int, procs: list, conns: list, threads_before: int | None) -> None:
        self.info = info  # this rank's place in its tensor-parallel group, and the control group
        self.world = world
        self.procs, self.conns = procs, conns
        self.threads_before = threads_before  # restored at shutdown (spawned ranks share the cores)
        self.ops: list[int] = []  # cache operations since the last step, sent with it
        self.rank_bytes: list[tuple[int, int]] = []  # (weight bytes, KV bytes) per rank
        self.steps = 0
        self.message_bytes = 0
        self.dead: str | None = None
        self.closed = False

    # -- start -----------------------------------------------------------------------------------
    @staticmethod
    def check_alone() -> None:
        if dist.is_initialized() and torchrun_world() == 1:
            raise ValueError(
                "another tensor- or pipeline-parallel LLM is running in this process; call its "
                "shutdown() first (torch.distributed keeps one group per process)"
            )

    def spawn(self, target: Callable, args_of: Callable[[int, str], tuple], threads: int, name: str) -> str:
        """Start ranks 1 .. world - 1 on this machine, each `target(*args_of(rank, init_method),
        pipe)`, and wait until each has started; this process keeps `threads` threads. Returns
        the rendezvous address. On any failure, what started is stopped."""
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        try:
            for rank in range(1, self.world):
                parent, child = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=target, args=(*args_of(rank, init_method), child), name=f"{name}{rank}", daemon=True
                )
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            self._wait_for("started", 120)
        except BaseException:
            self.shutdown()
            raise
        return init_method

    def wait_loaded(self) -> None:
        """Block until every spawned rank has loaded its part; a rank's error is raised here."""
        self._wait_for("loaded", settings.get("tp_load_timeout_s"))

    def _wait_for(self, what: str, timeout: float) -> None:
        wait_for_ranks(self.procs, self.conns, what, timeout, self.kind, self.size_arg, self.error)

    def load_args(self) -> dict:
        """What load_model takes to load rank 0's part."""
        raise NotImplementedError

    # -- the cache -------------------------------------------------------------------------------
    def recorded_copy(self, copy_fn: Callable[[int, int, int], None]) -> Callable[[int, int, int], None]:
        """The copy function the block manager calls: each prefix copy runs here and is queued
        for the other ranks, which apply it before the next step's forward."""
        ops = self.ops

        def copy(src: int, dst: int, n: int) -> None:
            ops.extend((messages.OP_COPY_PREFIX, src, dst, n))
            copy_fn(src, dst, n)

        return copy

    def gather_sizes(self, weight_bytes: int, kv_bytes: int) -> None:
        """Collect every rank's weight and KV bytes (for the trace), given rank 0's own."""
        mine = torch.tensor([weight_bytes, kv_bytes], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        with self.guard():
            dist.gather(mine, parts, dst=0, group=self.info.control)
        self.rank_bytes = [tuple(int(x) for x in p.tolist()) for p in parts]

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Where a subclass turns a failed collective into its error."""
        yield

    # -- faults and stop -------------------------------------------------------------------------
    def ended_ranks(self) -> list[str]:
        """The spawned ranks that have exited, and how."""
        return [
            f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
            for r, p in enumerate(self.procs, start=1)
            if not p.is_alive()
        ]

    def stop_ranks(self) -> None:
        """Join the spawned ranks (after STOP), kill those that do not exit, release the groups
        and give this process its threads back."""
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                logger.warning("%s %s did not stop; killing it", self.kind, p.name)
                p.kill()
                p.join(timeout=5)
        for c in self.conns:
            c.close()
        destroy_groups(self.info)
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)

    def shutdown(self) -> None:
        """Stop every rank: STOP on the control group (unless the group has failed), then
        `stop_ranks`. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if not self.dead and self.info.control is not None:
            try:
                self._before_stop()
                messages.send(self.info.control, messages.STOP)
                self._after_stop()
            except Exception as e:
                logger.warning("%s stop: %s", self.kind, e)
        self.stop_ranks()

    def _before_stop(self) -> None:
        """What must reach the ranks before STOP (a pipeline's steps still in flight)."""

    def _after_stop(self) -> None:
        """What the ranks send back after STOP (a pipeline's time records)."""

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]
