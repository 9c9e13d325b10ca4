"""Logical KV blocks: free list, reference counts, and the prefix cache.

Block 0 is the null block: never handed out, kept zeroed, and used to pad block
tables and to stand in for blocks a sliding window has released, so reads of
positions a sequence does not hold see finite values that the mask then ignores.

The free list is a stack: the most recently freed block is handed out first, so
a long-running engine cycles through a small working set and the CPU pages of
blocks it never needed are never committed (the pools are lazily allocated).
Blocks never handed out sit below every freed one, lowest id on top, so the
blocks ever touched are exactly 1..`num_touched`. The prefix cache's LRU
eviction order is separate and unchanged.

Prefix caching. Every full block gets a chained hash (parent hash, its token
ids, an extra key); a new sequence reuses the longest run of cached blocks
that matches its prompt, each checked against its tokens and its parent's hash (so a hash
collision between two chains is never served). Past block granularity, a block whose first tokens
match the prompt's next ones (a diverging prompt, or the partial tail a
finished sequence left) is copied up to the match into a fresh block instead
of recomputing those tokens. Blocks nobody references stay cached in an LRU
until their memory is needed; a finished sequence's blocks enter it leaf
first so eviction frees leaves before the shared trunk. At most
`max_cached_seqs` finished sequences are kept as reusable prefixes.

KV groups (kv/groups.py). A sequence holds one block table per group of layers: one
group for most models, and for models that mix sliding and global layers (Gemma 2/3) a
group of global layers plus groups of sliding ones, every block a page of the same number
of layers, all from this one pool. Group g's blocks are hashed with g in the key, so a
cached block is only ever matched by its own group.

Sliding windows (Mistral, Gemma's local layers). Blocks behind a sequence's window are
released as it advances; with caching on they keep their content in the LRU like any
other. A prompt then needs only the window before its reuse point: the match walks the
prompt's chain of hashes (computed from its tokens) and takes the furthest full block whose
preceding window of blocks is still cached in every sliding group and whose whole chain is
cached in every global group, leaving released entries null. Every block's hash chains over
the whole prefix before it, so a reused block holds exactly the K/V that recomputing would
write.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from ..config import cdiv
from ..kv.groups import blocks_held
from .sequence import Sequence

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


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache (full blocks + partial copies)
    partial_hits: int = 0  # of which served by copying part of a block
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def block_hash(parent: int, tokens: tuple[int, ...], extra: object = None) -> int:
    return hash((parent, tokens, extra))


@dataclass
class _Retained:
    blocks: list[int] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 max_cached_seqs: int = 16,
                 copy_fn: Callable[[int, int, int], None] | None = None,
                 group_windows: list[int | None] | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_cached_seqs = max_cached_seqs
        # Per KV group: its layers' sliding window, or None (global layers keep every block).
        self.group_windows = list(group_windows or [None])
        self.num_groups = len(self.group_windows)
        # copy_fn(src, dst, n_tokens): copies K/V slots between physical blocks.
        self.copy_fn = copy_fn
        self.blocks = [BlockMeta() for _ in range(num_blocks)]
        # No content; a stack whose top (right end) is handed out next.
        self.free_ids: deque[int] = deque(range(num_blocks - 1, 0, -1))
        self.num_touched = 0  # blocks ever handed out: ids 1..num_touched
        self.peak_used = 0  # most blocks referenced by live sequences at once
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self.by_hash: dict[int, int] = {}
        self.children: dict[int, set[int]] = {}  # parent hash -> cached blocks that follow it
        self.retained: OrderedDict[int, _Retained] = OrderedDict()  # finished seq id -> blocks
        self.stats = PrefixCacheStats()
        self.token_exact = True  # also reuse part of a block (off: block-granular, for comparison)
        self._last_match = (0, 0)  # (cached tokens, of which partial) of the last match_prefix
        self._num_cached = 0  # blocks with content: see _has_content

    # -- capacity ---------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or evictable)."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by live sequences."""
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding reusable content (referenced or not); kept as a count because
        the server's metrics read it every step."""
        return self._num_cached

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must take so each of its tables covers `num_tokens`, plus a
        copy-on-write copy where the block its next token goes into is shared."""
        need = 0
        i = seq.num_computed_tokens // self.block_size
        for table in self.tables(seq):
            need += max(0, cdiv(num_tokens, self.block_size) - len(table))
            if i < len(table) and self.blocks[table[i]].ref_count > 1:
                need += 1
        return need

    def max_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one sequence of `num_tokens` holds at once (kv/groups.py)."""
        return blocks_held(self.group_windows, num_tokens, self.block_size, chunk)

    def tables(self, seq: Sequence) -> list[list[int]]:
        """seq's block table of each group (group 0's is seq.block_table)."""
        if len(seq.group_tables) != self.num_groups - 1:
            seq.group_tables = [[] for _ in range(self.num_groups - 1)]
            seq.group_hashes = [[] for _ in range(self.num_groups - 1)]
            seq.table_version += 1
        return [seq.block_table, *seq.group_tables]

    def _hash_lists(self, seq: Sequence) -> list[list[int]]:
        self.tables(seq)
        return [seq.block_hashes, *seq.group_hashes]

    @staticmethod
    def _extra(g: int, extra: object) -> object:
        return extra if g == 0 else (g, extra)  # group 0 hashes as a single-group cache always did

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    # -- allocation -------------------------------------------------------
    def _take(self) -> int:
        if self.free_ids:
            bid = self.free_ids.pop()
            self.num_touched = max(self.num_touched, bid)
        elif self.evictable:
            bid, _ = self.evictable.popitem(last=False)
            self._uncache(bid)
            self.stats.evictions += 1
        else:
            raise NoFreeBlocksError("no free KV block")
        self.blocks[bid].ref_count = 1
        self.peak_used = max(self.peak_used, self.num_used_blocks)
        return bid

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq's table to cover num_tokens; copy a shared block it is about to write."""
        if self.blocks_needed(seq, num_tokens) > self.num_free_blocks:
            raise NoFreeBlocksError(f"{seq.request_id}: not enough free KV blocks")
        for table in self.tables(seq):
            self._copy_on_write(seq, table)
            while len(table) * self.block_size < num_tokens:
                table.append(self._take())

    def _copy_on_write(self, seq: Sequence, table: list[int]) -> None:
        i = seq.num_computed_tokens // self.block_size
        if i >= len(table):
            return
        old = table[i]
        if self.blocks[old].ref_count <= 1:
            return
        new = self._take()
        self._copy(old, new, seq.num_computed_tokens - i * self.block_size)
        self._decref(old)
        table[i] = new
        seq.table_version += 1

    def _copy(self, src: int, dst: int, n: int) -> None:
        if n > 0:
            if self.copy_fn is None:
                raise RuntimeError("block copy requested but no copy function is set")
            self.copy_fn(src, dst, n)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (copy-on-write on its first write)."""
        self.tables(parent)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.group_tables = [list(t) for t in parent.group_tables]
        child.group_hashes = [list(h) for h in parent.group_hashes]
        child.num_released = parent.num_released
        child.table_version += 1
        for table in self.tables(child):
            for bid in table:
                if bid != NULL_BLOCK:
                    self.blocks[bid].ref_count += 1

    def rewind(self, seq: Sequence, num_tokens: int) -> None:
        """seq keeps the K/V of its first num_tokens tokens only; the blocks past them go back."""
        seq.num_computed_tokens = num_tokens
        self.trim(seq)

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past seq's computed tokens, in every group: the slots of
        speculative proposals that were rejected. They were taken this step (private, never
        hashed); the slots of the block that stays are overwritten by the next tokens, and
        hashes cover computed tokens only."""
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        for table in self.tables(seq):
            while len(table) > keep:
                bid = table.pop()
                seq.table_version += 1
                if bid != NULL_BLOCK:
                    self._decref(bid, keep=False)
                else:
                    seq.num_released -= 1

    def release_window(self, seq: Sequence) -> int:
        """Free the blocks of each sliding group that lie wholly behind its window: the next
        query sits at num_computed_tokens and sees keys after it minus the window."""
        freed = 0
        for table, w in zip(self.tables(seq), self.group_windows):
            if w is not None:
                freed += self._release_before(table, seq.num_computed_tokens - w + 1)
        if freed:
            seq.num_released += freed
            seq.table_version += 1
        return freed

    def _release_before(self, table: list[int], first_needed_token: int) -> int:
        n_dead = max(0, first_needed_token) // self.block_size
        freed = 0
        for i in range(min(n_dead, len(table))):
            bid = table[i]
            if bid != NULL_BLOCK:
                self._decref(bid)
                table[i] = NULL_BLOCK
                freed += 1
        return freed

    def free(self, seq: Sequence, mode: str = "drop") -> None:
        """Drop seq's references. With caching on, `mode` says what happens to its content:
        "retain" (finished: kept as one of the max_cached_seqs reusable prefixes, its partial
        tail included), "keep" (preempted: stays cached until evicted, so the recompute
        hits it), "drop" (aborted: only blocks others retain stay cached)."""
        tables = self.tables(seq)
        keep = self.enable_caching and mode in ("keep", "retain")
        if self.enable_caching and mode == "retain" and self.max_cached_seqs > 0:
            kept = []
            for table, hashes in zip(tables, self._hash_lists(seq)):
                self._register_tail(seq, table, hashes)
                kept += [b for b in table if b != NULL_BLOCK and self._has_content(b)]
            for b in kept:
                self.blocks[b].retained_by += 1
            self.retained[seq.seq_id] = _Retained(kept)
        # Leaf first: the sequence's last block becomes the least recently used of its chain.
        for table in tables:
            for bid in reversed(table):
                if bid != NULL_BLOCK:
                    self._decref(bid, keep)
        seq.block_table = []
        seq.block_hashes = []
        seq.group_tables = []
        seq.group_hashes = []
        seq.num_released = 0
        seq.table_version += 1
        while len(self.retained) > (self.max_cached_seqs if self.enable_caching else 0):
            _, old = self.retained.popitem(last=False)
            for bid in old.blocks:
                self._unretain(bid)

    def _has_content(self, bid: int) -> bool:
        b = self.blocks[bid]
        return b.hash is not None or bool(b.tokens)

    def _unretain(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.retained_by > 0:
            b.retained_by -= 1
        if b.retained_by == 0 and b.ref_count == 0 and bid in self.evictable:
            del self.evictable[bid]
            self._uncache(bid)
            self.free_ids.append(bid)

    def _decref(self, bid: int, keep: bool = True) -> None:
        b = self.blocks[bid]
        if b.ref_count <= 0:
            raise AssertionError(f"block {bid} freed more often than it was allocated")
        b.ref_count -= 1
        if b.ref_count == 0:
            if self.enable_caching and self._has_content(bid) and (keep or b.retained_by > 0):
                self.evictable[bid] = None  # most recently used end
            else:
                self._uncache(bid)
                self.free_ids.append(bid)

    def _uncache(self, bid: int) -> None:
        b = self.blocks[bid]
        if self._has_content(bid):
            self._num_cached -= 1
        if b.hash is not None and self.by_hash.get(b.hash) == bid:
            del self.by_hash[b.hash]
        kids = self.children.get(b.parent)
        if kids is not None:
            kids.discard(bid)
            if not kids:
                del self.children[b.parent]
        b.hash, b.parent, b.tokens, b.retained_by = None, ROOT_HASH, (), 0

    # -- prefix cache -----------------------------------------------------
    def commit_full_blocks(self, seq: Sequence, extra: object = None) -> None:
        """Register blocks that became full of computed tokens so others can share them."""
        if not self.enable_caching:
            return
        bs = self.block_size
        n_full = seq.num_computed_tokens // bs
        for g, (table, hashes) in enumerate(zip(self.tables(seq), self._hash_lists(seq))):
            while len(hashes) < n_full:
                i = len(hashes)
                parent = hashes[-1] if hashes else ROOT_HASH
                tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                h = block_hash(parent, tokens, self._extra(g, extra))
                hashes.append(h)
                bid = table[i]
                b = self.blocks[bid]
                if bid == NULL_BLOCK or b.hash is not None:
                    continue
                b.hash, b.parent, b.tokens = h, parent, tokens
                self._num_cached += 1
                self.by_hash.setdefault(h, bid)
                self.children.setdefault(parent, set()).add(bid)

    def _register_tail(self, seq: Sequence, table: list[int], hashes: list[int]) -> None:
        """Make a finished sequence's partial last block matchable token-exactly."""
        bs = self.block_size
        i = len(hashes)
        n = seq.num_computed_tokens - i * bs
        if not (0 < n < bs) or i >= len(table):
            return
        bid = table[i]
        b = self.blocks[bid]
        if bid == NULL_BLOCK or b.hash is not None or b.tokens or b.ref_count != 1:
            return  # shared with a fork that may still write into it
        b.parent = hashes[-1] if hashes else ROOT_HASH
        b.tokens = tuple(seq.token_ids[i * bs:i * bs + n])
        self._num_cached += 1
        self.children.setdefault(b.parent, set()).add(bid)

    def match_prefix(self, seq: Sequence, extra: object = None) -> None:
        """Give a new (or preempted) sequence the cached blocks matching its prompt.

        Full blocks are shared; then the best partial match is copied into a new block.
        The last prompt token is always left to compute, so the step has logits."""
        if not self.enable_caching or seq.block_table:
            return
        bs = self.block_size
        ids = seq.token_ids
        limit = len(ids) - 1
        chains = [self._lookup_chain(ids, limit, self._extra(g, extra), w)
                  for g, w in enumerate(self.group_windows)]
        n = self._common_match(chains)
        for (hashes, found), w, table, hash_list in zip(chains, self.group_windows, self.tables(seq),
                                                         self._hash_lists(seq)):
            first = 0 if w is None else self._window_start(n, w)
            for i in range(n):
                bid = found[i] if i >= first else NULL_BLOCK
                if bid != NULL_BLOCK:
                    self._ref_cached(bid)
                else:
                    seq.num_released += 1
                table.append(bid)
                hash_list.append(hashes[i])
        hit = n * bs
        # Past whole blocks, a partial copy serves one group's table only: single-group caches.
        copied = 0
        if self.num_groups == 1:
            hashes = chains[0][0]
            copied = self._match_partial(seq, hashes[n - 1] if n else ROOT_HASH, hit, limit)
        seq.num_computed_tokens = hit + copied
        self._last_match = (hit + copied, copied)

    def _lookup_chain(self, ids: list[int], limit: int, extra: object,
                      window: int | None) -> tuple[list[int], list[int | None]]:
        """The chained hashes of the prompt's full blocks before `limit`, and the cached block
        holding each (None where none does); stops after the first miss unless the window slides."""
        bs = self.block_size
        hashes: list[int] = []
        found: list[int | None] = []
        parent, pos = ROOT_HASH, 0
        while pos + bs <= limit:
            tokens = tuple(ids[pos:pos + bs])
            h = block_hash(parent, tokens, extra)
            bid = self.by_hash.get(h)
            # A hash can collide: serve a block only if its tokens and its parent are ours.
            if bid is not None and (self.blocks[bid].tokens != tokens or self.blocks[bid].parent != parent):
                bid = None
            hashes.append(h)
            found.append(bid)
            if bid is None and window is None:
                break
            parent, pos = h, pos + bs
        return hashes, found

    def _window_start(self, n: int, window: int) -> int:
        """The first block a query at token n * bs still sees (keys after it minus the window);
        blocks before it stay null (never read)."""
        return max(0, n * self.block_size - window + 1) // self.block_size

    def _common_match(self, chains: list[tuple[list[int], list[int | None]]]) -> int:
        """The furthest n full blocks every group can serve: a global group its whole chain, a
        sliding group the window of blocks before block n."""
        top = min(len(found) for _, found in chains)
        for n in range(top, 0, -1):
            if all(all(b is not None for b in found[0 if w is None else self._window_start(n, w):n])
                   for (_, found), w in zip(chains, self.group_windows)):
                return n
        return 0

    def record_admission(self, seq: Sequence) -> None:
        """Count a lookup once its sequence is actually admitted (lookups may be retried).
        A recompute after preemption counts for the stats, not as the request's cached prompt."""
        if not self.enable_caching:
            return
        cached, partial = self._last_match
        self._last_match = (0, 0)
        self.stats.queries += seq.num_tokens
        self.stats.hits += cached
        self.stats.partial_hits += partial
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = cached

    def _match_partial(self, seq: Sequence, parent: int, start: int, limit: int) -> int:
        want = seq.token_ids[start:min(start + self.block_size, limit)]
        if not want or not self.token_exact:
            return 0
        best, best_n = None, 0
        for bid in self.children.get(parent, ()):
            n = _common_prefix(self.blocks[bid].tokens, want)
            if n > best_n:
                best, best_n = bid, n
        if best is None:
            return 0
        # Hold the source out of the LRU while a block is taken for the copy.
        self._ref_cached(best)
        if self.num_free_blocks == 0:
            self._decref(best)
            return 0
        dst = self._take()
        self._copy(best, dst, best_n)
        self._decref(best)
        seq.block_table.append(dst)
        return best_n

    def _ref_cached(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.ref_count == 0:
            self.evictable.pop(bid, None)
        b.ref_count += 1

    # -- checks -----------------------------------------------------------
    def check_invariants(self, live: list[Sequence]) -> None:
        """Every block is free, referenced by live tables (ref count = holders), or cached."""
        holders = [0] * self.num_blocks
        for s in live:
            for table in self.tables(s):
                for bid in table:
                    if bid != NULL_BLOCK:
                        holders[bid] += 1
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block is on the free list twice"
        for bid in range(1, self.num_blocks):
            b = self.blocks[bid]
            assert b.ref_count == holders[bid], f"block {bid}: ref {b.ref_count} != {holders[bid]} tables"
            states = (bid in free) + (bid in self.evictable) + (b.ref_count > 0)
            assert states == 1, f"block {bid} is in {states} states (free/evictable/referenced)"
            if bid in self.evictable:
                assert self._has_content(bid), f"evictable block {bid} holds nothing"
            if bid in free:
                assert not self._has_content(bid), f"free block {bid} still holds cached content"
        for h, bid in self.by_hash.items():
            assert self.blocks[bid].hash == h, f"hash index points at block {bid} with another hash"
        content = sum(1 for bid in range(1, self.num_blocks) if self._has_content(bid))
        assert self._num_cached == content, f"cached-block count {self._num_cached} != {content}"


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
