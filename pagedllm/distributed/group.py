"""One rank's place in a tensor-parallel group, and the collectives the model calls.

Two process groups, as vLLM keeps them: the compute group (NCCL on CUDA, gloo on the CPU)
carries the all-reduces and the logits gather with a short timeout, so a stuck rank fails a
step instead of hanging it; the control group (always gloo, CPU tensors) carries rank 0's
step plans and may wait as long as the engine stays idle. A rank that dies closes its
sockets, so its peers' pending collectives fail at once either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import settings

# Every rank joins within this (rank 0 waits here for its spawned workers to start).
RENDEZVOUS_TIMEOUT = timedelta(seconds=120)
# The control group waits for the next step while the engine is idle.
CONTROL_TIMEOUT = timedelta(days=7)  # (gloo keeps milliseconds in 32 bits)


@dataclass
class TPInfo:
    """This rank of `size`; `group` / `control` are set once the process groups exist."""

    rank: int = 0
    size: int = 1
    group: Any = None
    control: Any = None
    # Bytes this rank has all-reduced and gathered (the trace's per-step figure).
    reduced_bytes: int = 0
    reduces: int = 0
    stats: dict = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place."""
        dist.all_reduce(t, group=self.group)
        self.reduced_bytes += t.numel() * t.element_size()
        self.reduces += 1
        return t

    def gather_columns(self, t: torch.Tensor, total: int) -> torch.Tensor | None:
        """Rank 0 gets the ranks' column blocks of `t` [rows, cols_r] side by side, trimmed to
        `total` columns; the others get None. Blocks are padded to one width, as gather wants."""
        width = -(-total // self.size)
        if t.shape[1] < width:
            t = torch.nn.functional.pad(t, (0, width - t.shape[1]))
        t = t.contiguous()
        self.reduced_bytes += t.numel() * t.element_size()
        # group_dst: the group's first rank (under pipeline parallelism a stage's group is not
        # the world, so its first rank is not global rank 0).
        if self.rank != 0:
            dist.gather(t, None, group_dst=0, group=self.group)
            return None
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.gather(t, parts, group_dst=0, group=self.group)
        return torch.cat(parts, dim=1)[:, :total]


def init_groups(tp: TPInfo, device: torch.device, init_method: str | None) -> None:
    """Join (or create) the default group, then make the control and compute groups; fills
    `tp.control`/`tp.group`. `init_method` None: the environment (torchrun) says where rank 0
    listens."""
    if not dist.is_initialized():
        kw = {} if init_method is None else {"init_method": init_method}
        dist.init_process_group("gloo", rank=tp.rank, world_size=tp.size, timeout=RENDEZVOUS_TIMEOUT, **kw)
    elif dist.get_world_size() != tp.size:
        raise ValueError(
            f"tensor_parallel_size={tp.size} but torch.distributed already runs "
            f"{dist.get_world_size()} ranks; they must be equal"
        )
    tp.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    tp.group = dist.new_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        # How long one collective may wait for the other ranks (a layer's
        # all-reduce, a logits gather) before the step fails (PAGEDLLM_TP_TIMEOUT_S).
        # A dead worker closes its sockets and fails the collective at once;
        # this only catches a stuck one. 20 s tripped in the tests on a shared
        # 2-core machine whose load left a niced 1-thread rank that far behind,
        # hence 60.
        timeout=timedelta(seconds=settings.get("tp_timeout_s")),
    )


def destroy_groups(tp: TPInfo) -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group whose peer died may refuse a clean teardown
            pass
    tp.group = tp.control = None
