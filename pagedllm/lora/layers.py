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
        if len(slots) == 1:  # batch 1: no np.unique (a measurable share of a small model's step)
            s = int(slots[0])
            self.active, self.groups = (True, [(s, None)]) if s >= 0 else (False, [])
            return
        used = np.unique(slots)
        used = used[used >= 0]
        if len(used) == 0:
            self.active, self.groups = False, []
        elif len(used) == 1 and slots[0] == used[0] and (slots == used[0]).all():
            self.active, self.groups = True, [(int(used[0]), None)]
        else:
            self.active = True
            self.groups = [(int(s), torch.from_numpy(np.flatnonzero(slots == s)).to(device or "cpu")) for s in used]

    def clear(self) -> None:
        self.active, self.groups = False, []


class LinearLoRA:
    """One linear layer's adapter slots: A [r', in] and B^T [r', out] per slot (None: the adapter
    in that slot leaves this layer alone), B kept transposed so that both products read their
    weights row after row. The native decode stack reads B^T as `panels[slot]`: the output
    columns in panels of 32, each panel the B^T rows that are not zero there, one after another
    ([entries, 32]), with `panel_index[slot]` = [panel offsets (panels + 1), each entry's rank].
    A thread's share of the columns is then one run of memory, and a fused q|k|v or gate|up
    layer's zero blocks (each part's B sits block-diagonally) are neither stored nor read.
    The native path reads float32 adapters as bfloat16 copies (`a_native`, the panels): at
    decode sizes its cost is the bytes it streams, and the rounding (2^-9 of each weight of the
    delta) is far below the 4- to 8-bit rounding of the quantized base it runs beside."""

    def __init__(self, state: LoRAState, num_slots: int) -> None:
        self.state = state
        self.a: list[torch.Tensor | None] = [None] * num_slots
        self.bt: list[torch.Tensor | None] = [None] * num_slots
        self.a_native: list[torch.Tensor | None] = [None] * num_slots
        self.panels: list[torch.Tensor | None] = [None] * num_slots
        self.panel_index: list[torch.Tensor | None] = [None] * num_slots

    @property
    def active(self) -> bool:
        return self.state.active

    def set_slot(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """pair: (A [r', in], B [out, r']) or None to empty the slot."""
        if pair is None:
            self.a[slot] = self.bt[slot] = self.a_native[slot] = self.panels[slot] = self.panel_index[slot] = None
        else:
            a, b = pair
            self.a[slot], self.bt[slot] = a.contiguous(), b.t().contiguous()
            if b.device.type == "cpu":  # (only the CPU's native decode reads them)
                native = torch.bfloat16 if a.dtype == torch.float32 else a.dtype
                self.a_native[slot] = self.a[slot].to(native)
                self.panels[slot], self.panel_index[slot] = _panels(self.bt[slot].to(native))
        self.state.version += 1

    def slot_nbytes(self, slot: int) -> int:
        """What the adapter in `slot` holds in this layer."""
        held = {
            id(t): t
            for t in (self.a[slot], self.bt[slot], self.a_native[slot], self.panels[slot], self.panel_index[slot])
            if t is not None
        }  # (a_native may be a itself)
        return sum(t.numel() * t.element_size() for t in held.values())

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


PANEL = 32  # output columns a panel (csrc/decode_stack.cpp reads the same width)


def _panels(bt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """B^T [r, out] as panels of PANEL columns: [entries, PANEL] (each panel's nonzero rows in
    rank order, the last panel zero-padded) and the int64 index [panel offsets..., entry ranks...]."""
    r, n = bt.shape
    npan = -(-n // PANEL)
    padded = torch.nn.functional.pad(bt, (0, npan * PANEL - n)).view(r, npan, PANEL).transpose(0, 1)
    used = padded.ne(0).any(2)  # [panels, r]
    entries = used.nonzero()  # (panel, rank), panel-major and rank-minor
    offsets = torch.zeros(npan + 1, dtype=torch.int64)
    offsets[1:] = used.sum(1).cumsum(0)
    data = padded[entries[:, 0], entries[:, 1]].contiguous()
    return data, torch.cat([offsets, entries[:, 1].to(torch.int64)]).cpu().contiguous()
