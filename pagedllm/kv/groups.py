"""KV groups: which layers share a block table, and where each layer's pages live.

A model whose layers all attend alike (all global, or all sliding by one window: Mistral)
has one group: every block is a page of every layer, as before. A model that mixes sliding
and global layers (Gemma 2 alternates, Gemma 3 has five sliding layers per global one) would
keep every sliding layer's whole history in such a table, though it reads only its window.
So, as in vLLM v1's hybrid allocator, the layers are split into groups of one kind and equal
size S: the global layers in groups of S, the sliding layers in groups of S (the last one
padded). A block is then a page of S layers, all groups draw from one pool (one budget, one
free list), each sequence has one table per group, and a sliding group gives its blocks back
as the window moves. The pool stores S layer slots; layer i uses slot `layer_slot[i]` of the
blocks in its group's table.

Gemma 3 1B (26 layers, 4 global): S = 4, one global group and six sliding groups (the
last with two layers and two idle slots). An 8,192-token sequence at window 512 and
blocks of 32 holds 256 global blocks + 6 x 17 sliding blocks of 4 layers, instead of 256
blocks of 26 layers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVGroups:
    windows: list[int | None]  # per group: its layers' window (None: global)
    layers: list[list[int]]  # per group: its layers, in slot order
    slots: int  # layers per page (S)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def layer_group(self) -> dict[int, int]:
        return {layer: g for g, ls in enumerate(self.layers) for layer in ls}

    @property
    def layer_slot(self) -> dict[int, int]:
        return {layer: j for ls in self.layers for j, layer in enumerate(ls)}

    def describe(self) -> str:
        if self.num_groups == 1:
            w = self.windows[0]
            return f"1 group of {self.slots} layers" + ("" if w is None else f", sliding window {w}")
        parts = []
        for w in dict.fromkeys(self.windows):
            n = self.windows.count(w)
            layers = sum(len(ls) for ls, gw in zip(self.layers, self.windows) if gw == w)
            parts.append(f"{n} {'global' if w is None else f'sliding ({w})'} group(s), {layers} layers")
        return (
            f"{self.num_groups} block tables per sequence: "
            + "; ".join(parts)
            + f"; each block a page of {self.slots} layers"
        )


def plan_groups(layer_windows: list[int | None], num_layers: int, hybrid: bool = True) -> KVGroups:
    """Group layers by window. One group unless the layers differ and `hybrid` (paged
    attention; the contiguous backend keeps per-sequence buffers and one accounting table,
    which then keeps every block, sliding layers' included)."""
    windows = layer_windows or [None] * num_layers
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        kinds.setdefault(w, []).append(i)
    if len(kinds) == 1:
        return KVGroups([windows[0]], [list(range(num_layers))], num_layers)
    if not hybrid:
        return KVGroups([None], [list(range(num_layers))], num_layers)
    size = min(len(ls) for ls in kinds.values())
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))  # global first: group 0
    out_w, out_l = [], []
    for w in order:
        ls = kinds[w]
        for k in range(0, len(ls), size):
            out_w.append(w)
            out_l.append(ls[k : k + size])
    return KVGroups(out_w, out_l, size)


def blocks_held(windows: list[int | None], num_tokens: int, block_size: int, chunk: int) -> int:
    """The most blocks one sequence of `num_tokens` holds at once, computing up to `chunk`
    tokens a step: a global group holds them all, a sliding group its window and a chunk."""
    n = -(-num_tokens // block_size)
    return sum(n if w is None else min(n, -(-(w + chunk) // block_size) + 1) for w in windows)
