"""Logical KV blocks: a free list and reference counts.

Block 0 is the null block: never handed out, kept zeroed, and used to pad block
tables and to stand in for blocks a sliding window has released, so gathers
always read finite values that the attention mask then ignores.
"""
from __future__ import annotations

from collections import deque

from ..config import cdiv
from .sequence import Sequence

NULL_BLOCK = 0


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(1, num_blocks))

    # -- capacity ---------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def blocks_to_grow(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain so its table covers `num_tokens` tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_to_grow(seq, num_tokens) <= self.num_free_blocks

    # -- mutation ---------------------------------------------------------
    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_to_grow(seq, num_tokens)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            bid = self.free_ids.popleft()
            self.ref_counts[bid] = 1
            seq.block_table.append(bid)

    def release_before(self, seq: Sequence, first_needed_token: int) -> int:
        """Free blocks whose tokens all lie before `first_needed_token` (sliding windows)."""
        n_dead = first_needed_token // self.block_size
        freed = 0
        for i in range(min(n_dead, len(seq.block_table))):
            bid = seq.block_table[i]
            if bid != NULL_BLOCK:
                self._decref(bid)
                seq.block_table[i] = NULL_BLOCK
                freed += 1
        return freed

    def free(self, seq: Sequence) -> None:
        for bid in seq.block_table:
            if bid != NULL_BLOCK:
                self._decref(bid)
        seq.block_table = []

    def _decref(self, bid: int) -> None:
        rc = self.ref_counts[bid] - 1
        if rc < 0:
            raise AssertionError(f"block {bid} freed more often than it was allocated")
        self.ref_counts[bid] = rc
        if rc == 0:
            self.free_ids.append(bid)
