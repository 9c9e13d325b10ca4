"""The grouped low-rank products of one step, as Punica / S-LoRA's SGMV group them.

The runner gives the step one adapter slot per token (-1: the base model). `LoRAState.set_step`
turns that into groups once per step (a slot and the rows that use it); each linear layer with
an adapter then adds, per group, (x[rows] @ A^T) @ B^T to its output rows. A step whose rows all
run the base sets `active` False, and the layers do nothing more than read that flag.
"""
from __future__ import annotations

import numpy as np
import torch


class LoRAState:
    """The step's row groups, shared by every linear layer with adapter slots."""

    def __init__(self) -> None:
        self.active = False
        # (slot, row indices, or None when every row of the step uses that slot)
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        self.version = 0  # bumped when any layer's slot changes (the native stack's lists follow it)

    def set_step(self, slots: np.ndarray | None, device: torch.device | None = None) -> None:
        if slots is None or len(slots) == 0:
            self.active, self.groups = False, []
            return
        used = np.unique(slots)
        used = used[used >= 0]
        if len(used) == 0:
            self.active, self.groups = False, []
        elif len(used) == 1 and slots[0] == used[0] and (slots == used[0]).all():
            self.active, self.groups = True, [(int(used[0]), None)]
        else:
            self.active = True
            self.groups = [(int(s), torch.from_numpy(np.flatnonzero(slots == s)).to(device or "cpu"))
                           for s in used]

    def clear(self) -> None:
        self.active, self.groups = False, []


class LinearLoRA:
    """One linear layer's adapter slots: A [r', in] and B^T [r', out] per slot (None: the adapter
    in that slot leaves this layer alone). B is kept transposed so that both products read their
    weights row after row, here and in the native decode stack; `spans[slot]` [r', 2] holds, for
    each of B^T's rows, the output columns [start, end) where it is not zero (a fused q|k|v or
    gate|up layer places each part's B block-diagonally: the native expand skips the zeros)."""

    def __init__(self, state: LoRAState, num_slots: int) -> None:
        self.state = state
        self.a: list[torch.Tensor | None] = [None] * num_slots
        self.bt: list[torch.Tensor | None] = [None] * num_slots
        self.spans: list[torch.Tensor | None] = [None] * num_slots

    @property
    def active(self) -> bool:
        return self.state.active

    def set_slot(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """pair: (A [r', in], B [out, r']) or None to empty the slot."""
        if pair is None:
            self.a[slot] = self.bt[slot] = self.spans[slot] = None
        else:
            a, b = pair
            self.a[slot], self.bt[slot] = a.contiguous(), b.t().contiguous()
            self.spans[slot] = _nonzero_spans(self.bt[slot])
        self.state.version += 1

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base output of x, a tensor of the caller's own) plus each group's low-rank
        product on its rows, added in place: a prefill's y is large, and a copy of it per group
        cost more than the products."""
        x2 = x.reshape(-1, x.shape[-1])
        y = y.contiguous()
        y2 = y.view(-1, y.shape[-1])
        for slot, rows in self.state.groups:
            a, bt = self.a[slot], self.bt[slot]
            if a is None:
                continue
            if rows is None:
                y2.addmm_(x2 @ a.t(), bt)
            else:
                y2.index_add_(0, rows, (x2.index_select(0, rows) @ a.t()) @ bt)
        return y


def _nonzero_spans(bt: torch.Tensor) -> torch.Tensor:
    """[rows, 2] int64: per row of bt, the first nonzero column and one past the last ([0, 0]
    for a zero row)."""
    nz = bt != 0
    cols = torch.arange(bt.shape[1], device=bt.device)
    any_ = nz.any(1)
    start = torch.where(nz, cols, bt.shape[1]).amin(1)
    end = torch.where(nz, cols + 1, 0).amax(1)
    return torch.stack([torch.where(any_, start, 0), torch.where(any_, end, 0)], 1).cpu().contiguous()
