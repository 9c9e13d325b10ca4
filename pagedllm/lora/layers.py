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
    """One linear layer's adapter slots: A [r', in] and B [out, r'] per slot (None: the adapter
    in that slot leaves this layer alone)."""

    def __init__(self, state: LoRAState, num_slots: int) -> None:
        self.state = state
        self.a: list[torch.Tensor | None] = [None] * num_slots
        self.b: list[torch.Tensor | None] = [None] * num_slots

    @property
    def active(self) -> bool:
        return self.state.active

    def set_slot(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.a[slot], self.b[slot] = (None, None) if pair is None else pair

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base output of x) plus each group's low-rank product on its rows."""
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.reshape(-1, y.shape[-1])
        for slot, rows in self.state.groups:
            a, b = self.a[slot], self.b[slot]
            if a is None:
                continue
            if rows is None:
                y2 = y2 + (x2 @ a.t()) @ b.t()
            else:
                y2 = y2.index_add(0, rows, (x2.index_select(0, rows) @ a.t()) @ b.t())
        return y2.view(y.shape)
