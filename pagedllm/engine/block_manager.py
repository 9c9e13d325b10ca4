"""Logical KV blocks of one model: its block tables over the shared pool, and the prefix cache.

The blocks themselves (free list, reference counts, the LRU of cached blocks, the hash
index) are the BlockPool's (block_pool.py), shared by every model of the engine: the
target's BlockManager and, with draft-model speculation, the draft's, each over its own KV
groups. A manager built without a pool gets one of its own.

Block 0 is the null block: never handed out, kept zeroed, and used to pad block
tables and to stand in for blocks a sliding window has released, so reads of
positions a sequence does not hold see finite values that the mask then ignores.

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
of layers, all from the one pool. A group's blocks are hashed with its pool-wide id in the
key, so a cached block is only ever matched by its own group (and model).

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

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from ..config import cdiv
from ..kv.groups import blocks_held
from .block_pool import NULL_BLOCK, ROOT_HASH, BlockMeta, BlockPool, NoFreeBlocksError
from .sequence import Sequence

__all__ = [
    "NULL_BLOCK",
    "ROOT_HASH",
    "BlockMeta",
    "BlockPool",
    "BlockManager",
    "NoFreeBlocksError",
    "PrefixCacheStats",
    "block_hash",
]


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache (full blocks + partial copies)
    partial_hits: int = 0  # of which served by copying part of a block
    evictions: int = 0  # cached blocks this manager's allocations evicted

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def block_hash(parent: int, tokens: tuple[int, ...], extra: object = None) -> int:
    return hash((parent, tokens, extra))


@dataclass
class _Retained:
    blocks: list[int] = field(default_factory=list)


class BlockManager:
    """One model's block tables over a BlockPool (block_pool.py): its own pool unless
    `pool` is given, in which case it shares that pool's blocks, free list and budget with
    the managers already on it (a draft model's beside the target's)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = False,
        max_cached_seqs: int = 16,
        copy_fn: Callable[[int, int, int], None] | None = None,
        group_windows: list[int | None] | None = None,
        pool: BlockPool | None = None,
    ) -> None:
        self.pool = pool if pool is not None else BlockPool(num_blocks)
        if self.pool.num_blocks != num_blocks:
            raise ValueError(f"a block manager of {num_blocks} blocks over a pool of {self.pool.num_blocks}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_cached_seqs = max_cached_seqs
        # Per KV group: its layers' sliding window, or None (global layers keep every block).
        self.group_windows = list(group_windows or [None])
        self.num_groups = len(self.group_windows)
        # The pool-wide id of each of this model's groups: what its blocks' hashes key.
        self.group_ids = self.pool.add_groups(self.num_groups)
        # copy_fn(src, dst, n_tokens): copies K/V slots between this model's physical blocks.
        self.copy_fn = copy_fn
        self.retained: OrderedDict[int, _Retained] = OrderedDict()  # finished seq id -> blocks
        self.stats = PrefixCacheStats()
        self.token_exact = True  # also reuse part of a block (off: block-granular, for comparison)
        self._last_match = (0, 0)  # (cached tokens, of which partial) of the last match_prefix
        # Block ids this model's tables ever held: its own pages ever written (lazy CPU pools).
        self._touched = bytearray(num_blocks)
        self.num_touched = 0
        self.peak_used = 0  # most blocks this model's live tables held at once

    # -- the pool ---------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def blocks(self) -> list[BlockMeta]:
        return self.pool.blocks

    @property
    def free_ids(self):
        return self.pool.free_ids

    @property
    def evictable(self):
        return self.pool.evictable

    @property
    def by_hash(self) -> dict[int, int]:
        return self.pool.by_hash

    # -- capacity ---------------------------------------------------------
    # The pool's figures: one budget, whichever model's tables hold its blocks.
    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or evictable), to any model."""
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by live sequences, of every model on the pool."""
        return self.pool.num_used_blocks

    @property
    def num_held_blocks(self) -> int:
        """Blocks referenced by this model's tables."""
        return sum(self.pool.used_by_group[g] for g in self.group_ids)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding reusable content (referenced or not), in the whole pool; kept as a
        count because the server's metrics read it every step."""
        return self.pool.num_cached

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

    def _extra(self, g: int, extra: object) -> object:
        """The hash key of this model's group g: its pool-wide id (the pool's first group, the
        target's global layers, hashes as a single-group cache always did)."""
        gid = self.group_ids[g]
        return extra if gid == 0 else (gid, extra)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    # -- allocation -------------------------------------------------------
    def _take(self, g: int) -> int:
        """A block for this model's group g, from the pool."""
        evicted = self.pool.evictions
        bid = self.pool.take(self.group_ids[g])
        self.stats.evictions += self.pool.evictions - evicted
        if not self._touched[bid]:
            self._touched[bid] = 1
            self.num_touched += 1
        self.peak_used = max(self.peak_used, self.num_held_blocks)
        return bid

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq's table to cover num_tokens; copy a shared block it is about to write."""
        if self.blocks_needed(seq, num_tokens) > self.num_free_blocks:
            raise NoFreeBlocksError(f"{seq.request_id}: not enough free KV blocks")
        for g, table in enumerate(self.tables(seq)):
            self._copy_on_write(seq, table, g)
            while len(table) * self.block_size < num_tokens:
                table.append(self._take(g))

    def _copy_on_write(self, seq: Sequence, table: list[int], g: int) -> None:
        i = seq.num_computed_tokens // self.block_size
        if i >= len(table):
            return
        old = table[i]
        if self.blocks[old].ref_count <= 1:
            return
        new = self._take(g)
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
                    self.pool.ref(bid)

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
                kept += [b for b in table if b != NULL_BLOCK and self.pool.has_content(b)]
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

    def _unretain(self, bid: int) -> None:
        self.pool.unretain(bid)

    def _decref(self, bid: int, keep: bool = True) -> None:
        # Content exists only where caching is on (nothing registers it otherwise).
        self.pool.decref(bid, keep)

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
                parent = hashes[-1] if hashes else root_of(seq)
                tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                h = block_hash(
                    parent,
                    tokens,
                    self._extra(g, extra if seq.mm is None else _with_images(extra, seq.mm.block_key(i, bs))),
                )
                hashes.append(h)
                bid = table[i]
                if bid == NULL_BLOCK or self.blocks[bid].hash is not None:
                    continue
                self.pool.register(bid, h, parent, tokens)

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
        parent = hashes[-1] if hashes else root_of(seq)
        self.pool.register(bid, None, parent, tuple(seq.token_ids[i * bs : i * bs + n]))

    def match_prefix(self, seq: Sequence, extra: object = None) -> None:
        """Give a new (or preempted) sequence the cached blocks matching its prompt.

        Full blocks are shared; then the best partial match is copied into a new block.
        The last prompt token is always left to compute, so the step has logits."""
        if not self.enable_caching or seq.block_table:
            return
        bs = self.block_size
        ids = seq.token_ids
        limit = len(ids) - 1
        root = root_of(seq)
        chains = [self._lookup_chain(ids, limit, g, extra, w, root, seq.mm) for g, w in enumerate(self.group_windows)]
        n = self._common_match(chains)
        for (hashes, found), w, table, hash_list in zip(
            chains, self.group_windows, self.tables(seq), self._hash_lists(seq)
        ):
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
            copied = self._match_partial(seq, hashes[n - 1] if n else root, hit, limit)
        seq.num_computed_tokens = hit + copied
        self._last_match = (hit + copied, copied)

    def _lookup_chain(
        self, ids: list[int], limit: int, g: int, extra: object, window: int | None, root: int = ROOT_HASH, mm=None
    ) -> tuple[list[int], list[int | None]]:
        """The chained hashes of group g's full blocks of the prompt before `limit`, and the
        cached block holding each (None where none does); stops after the first miss unless
        the window slides. `mm`: a prompt's images, whose hashes key the blocks they are in."""
        bs = self.block_size
        key, gid = self._extra(g, extra), self.group_ids[g]
        hashes: list[int] = []
        found: list[int | None] = []
        parent, pos = root, 0
        while pos + bs <= limit:
            tokens = tuple(ids[pos : pos + bs])
            if mm is not None:
                key = self._extra(g, _with_images(extra, mm.block_key(pos // bs, bs)))
            h = block_hash(parent, tokens, key)
            bid = self.pool.cached(h, gid, parent, tokens)
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
            if all(
                all(b is not None for b in found[0 if w is None else self._window_start(n, w) : n])
                for (_, found), w in zip(chains, self.group_windows)
            ):
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
        want = seq.token_ids[start : min(start + self.block_size, limit)]
        if not want or not self.token_exact:
            return 0
        if seq.mm is not None and seq.mm.block_key(start // self.block_size, self.block_size) is not None:
            return 0  # a partial block's tokens are matched without keys: never one with image tokens
        best, best_n = None, 0
        for bid in self.pool.children.get((self.group_ids[0], parent), ()):
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
        dst = self._take(0)
        self._copy(best, dst, best_n)
        self._decref(best)
        seq.block_table.append(dst)
        return best_n

    def _ref_cached(self, bid: int) -> None:
        self.pool.ref(bid)

    # -- checks -----------------------------------------------------------
    def check_invariants(self, live: list[Sequence]) -> None:
        """The pool's invariants, and every block of this model's groups referenced exactly by
        the tables of `live` (all its live sequences): ref count = holders, nothing held by a
        table of another group."""
        self.pool.check_invariants()
        holders = [0] * self.num_blocks
        owner: dict[int, int] = {}
        for s in live:
            for gid, table in zip(self.group_ids, self.tables(s)):
                for bid in table:
                    if bid != NULL_BLOCK:
                        holders[bid] += 1
                        owner[bid] = gid
        mine = set(self.group_ids)
        for bid in range(1, self.num_blocks):
            b = self.blocks[bid]
            if b.ref_count > 0 and b.group in mine or holders[bid]:
                assert b.ref_count == holders[bid], f"block {bid}: ref {b.ref_count} != {holders[bid]} tables"
            if holders[bid]:
                assert b.group == owner[bid], f"block {bid} of group {b.group} sits in a table of group {owner[bid]}"


def root_of(seq: Sequence) -> int:
    """The parent hash of a sequence's first block: the shared root for the base model, its
    adapter's own root under LoRA, so two adapters never share K/V while one adapter's requests do."""
    return ROOT_HASH if seq.lora is None else block_hash(ROOT_HASH, (), seq.lora.cache_key)


def _with_images(extra: object, images: tuple[str, ...] | None) -> object:
    """A block's extra key with the hashes of the images it holds tokens of (None: none)."""
    return extra if images is None else (extra, images)


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
