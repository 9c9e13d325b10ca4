"""The pool of KV blocks every model of the engine draws from: one budget, one free list.

As in vLLM v1's KV cache manager, one BlockPool is shared by per-model block managers
(block_manager.py): the target's and, with draft-model speculation, the draft's. Each
manager registers its KV groups here and gets pool-wide group ids, so a block belongs to
one group's tables at a time, its prefix-cache hash keys that group (the draft's cached
K/V never matches the target's), and the pool counts the blocks each group holds. The
physical pages stay with each model (kv/cache.py): a block id indexes a page in every
model's cache, and on the CPU, where the pools are lazily allocated, only the model whose
table holds the block ever writes (and commits) its page.

Here: reference counts, the free list, the LRU of cached blocks nobody references, the
hash index and the token-exact children index. Hashing, block tables and the policies
(what to keep, what to match) are the managers'.

The free list is a stack: the most recently freed block is handed out first, so a
long-running engine cycles through a small working set and the CPU pages of blocks it
never needed are never committed. Blocks never handed out sit below every freed one,
lowest id on top, so the blocks ever touched are exactly 1..`num_touched`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

NULL_BLOCK = 0
ROOT_HASH = 0  # the parent of every sequence's first block


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass
class BlockMeta:
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered
    parent: int = ROOT_HASH  # hash of the block before it in its sequence
    tokens: tuple[int, ...] = ()  # the tokens whose K/V the block holds (cached blocks)
    retained_by: int = 0  # finished sequences keeping it as a reusable prefix
    group: int = -1  # the pool-wide KV group whose tables hold it (set when handed out)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [BlockMeta() for _ in range(num_blocks)]
        # No content; a stack whose top (right end) is handed out next.
        self.free_ids: deque[int] = deque(range(num_blocks - 1, 0, -1))
        self.num_touched = 0  # blocks ever handed out: ids 1..num_touched
        self.peak_used = 0  # most blocks referenced at once, every group together
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self.by_hash: dict[int, int] = {}
        # (group, parent hash) -> cached blocks that follow it: a partial match copies K/V
        # between pages of one model only.
        self.children: dict[tuple[int, int], set[int]] = {}
        self.used_by_group: list[int] = []  # referenced blocks, per registered group
        self.num_cached = 0  # blocks with content: see has_content
        self.evictions = 0

    def add_groups(self, n: int) -> list[int]:
        """Register a model's n KV groups; returns their pool-wide ids (the first model's
        are 0..n-1, so a single model hashes as it always did)."""
        first = len(self.used_by_group)
        self.used_by_group += [0] * n
        return list(range(first, first + n))

    # -- capacity ---------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1  # block 0 is the null block

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or evictable)."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by live sequences, of every model."""
        return self.num_usable_blocks - self.num_free_blocks

    # -- references -------------------------------------------------------
    def take(self, group: int) -> int:
        """A block for `group`'s tables, ref count 1: a free one, else the least recently
        used cached one (its content dropped)."""
        if self.free_ids:
            bid = self.free_ids.pop()
            self.num_touched = max(self.num_touched, bid)
        elif self.evictable:
            bid, _ = self.evictable.popitem(last=False)
            self.uncache(bid)
            self.evictions += 1
        else:
            raise NoFreeBlocksError("no free KV block")
        b = self.blocks[bid]
        b.ref_count, b.group = 1, group
        self.used_by_group[group] += 1
        self.peak_used = max(self.peak_used, self.num_used_blocks)
        return bid

    def ref(self, bid: int) -> None:
        """One more holder: a cached block matched (out of the LRU if nobody held it) or a
        block shared with a fork."""
        b = self.blocks[bid]
        if b.ref_count == 0:
            self.evictable.pop(bid, None)
            self.used_by_group[b.group] += 1
        b.ref_count += 1

    def decref(self, bid: int, keep: bool = True) -> None:
        """One holder fewer; at zero the block joins the LRU if it has content worth keeping
        (`keep`, or a finished sequence retains it), else the free list."""
        b = self.blocks[bid]
        if b.ref_count <= 0:
            raise AssertionError(f"block {bid} freed more often than it was allocated")
        b.ref_count -= 1
        if b.ref_count == 0:
            self.used_by_group[b.group] -= 1
            if self.has_content(bid) and (keep or b.retained_by > 0):
                self.evictable[bid] = None  # most recently used end
            else:
                self.uncache(bid)
                self.free_ids.append(bid)

    def unretain(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.retained_by > 0:
            b.retained_by -= 1
        if b.retained_by == 0 and b.ref_count == 0 and bid in self.evictable:
            del self.evictable[bid]
            self.uncache(bid)
            self.free_ids.append(bid)

    # -- content ----------------------------------------------------------
    def has_content(self, bid: int) -> bool:
        b = self.blocks[bid]
        return b.hash is not None or bool(b.tokens)

    def register(self, bid: int, h: int | None, parent: int, tokens: tuple[int, ...]) -> None:
        """bid holds the K/V of `tokens` after `parent` (h: its hash when the block is full,
        None for a partial tail, matchable token-exactly)."""
        b = self.blocks[bid]
        b.hash, b.parent, b.tokens = h, parent, tokens
        self.num_cached += 1
        if h is not None:
            self.by_hash.setdefault(h, bid)
        self.children.setdefault((b.group, parent), set()).add(bid)

    def cached(self, h: int, group: int, parent: int, tokens: tuple[int, ...]) -> int | None:
        """The cached block of hash h, if it really is group's block of `tokens` after `parent`
        (a hash can collide: a block is served only if its tokens and its parent are ours)."""
        bid = self.by_hash.get(h)
        if bid is None:
            return None
        b = self.blocks[bid]
        return bid if b.group == group and b.tokens == tokens and b.parent == parent else None

    def uncache(self, bid: int) -> None:
        b = self.blocks[bid]
        if self.has_content(bid):
            self.num_cached -= 1
        if b.hash is not None and self.by_hash.get(b.hash) == bid:
            del self.by_hash[b.hash]
        key = (b.group, b.parent)
        kids = self.children.get(key)
        if kids is not None:
            kids.discard(bid)
            if not kids:
                del self.children[key]
        b.hash, b.parent, b.tokens, b.retained_by = None, ROOT_HASH, (), 0

    # -- checks -----------------------------------------------------------
    def check_invariants(self) -> None:
        """Every block is in exactly one state (free, evictable or referenced), and the
        indexes and counts agree with the blocks."""
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block is on the free list twice"
        used = [0] * len(self.used_by_group)
        for bid in range(1, self.num_blocks):
            b = self.blocks[bid]
            states = (bid in free) + (bid in self.evictable) + (b.ref_count > 0)
            assert states == 1, f"block {bid} is in {states} states (free/evictable/referenced)"
            if b.ref_count > 0:
                used[b.group] += 1
            if bid in self.evictable:
                assert self.has_content(bid), f"evictable block {bid} holds nothing"
            if bid in free:
                assert not self.has_content(bid), f"free block {bid} still holds cached content"
        assert used == self.used_by_group, f"blocks held per group {self.used_by_group} != {used}"
        for h, bid in self.by_hash.items():
            assert self.blocks[bid].hash == h, f"hash index points at block {bid} with another hash"
        content = sum(1 for bid in range(1, self.num_blocks) if self.has_content(bid))
        assert self.num_cached == content, f"cached-block count {self.num_cached} != {content}"
