"""The draft model of speculative decoding: a small model with the target's vocabulary that
proposes up to k tokens a step by greedy decoding, inside the engine's step (after
sampling, as vLLM's drafter runs).

Its KV blocks come from the target's block pool (block_pool.py): the draft's KV groups are
registered there beside the target's, so one budget and one free list serve both, and a
block's prefix-cache hash keys its group, so the draft's K/V never matches the target's.
Its pages live in a paged cache of its own (its layers have other shapes), indexed by the
same block ids: on the CPU those pools are lazy, and a block id only the target uses costs
the draft's cache nothing. A sequence holds target blocks and draft blocks from the one
pool: the scheduler's room checks see both, preemption gives both back, and when the pool
is short the draft proposes less rather than take blocks the target's next step needs.

Each speculating sequence has a shadow here: the tokens whose K/V the draft holds, with its
block tables in the draft's view of the pool (a BlockManager over its groups). Before
proposing, the shadow is reconciled with the target sequence: the proposals the target
accepted keep their K/V, the rest is trimmed, and the draft computes whatever tokens it has
not seen (the prompt on first use, the target's own token after each verification, anything
added while speculation was paused) in one batched forward whose last rows give the first proposals. The other k - 1
proposals come from k - 1 one-row decode steps batched over every speculating sequence.
With prefix caching on (the target's setting), a new shadow starts from the draft's own
cached K/V of its prompt, and finished shadows leave theirs behind.

Greedy proposals are a function of the context alone, so the target's acceptance rule
(speculative/decoder.py) is exact rejection sampling for a deterministic draft: greedy output is the
target's, sampled output has the target's distribution, and seeded rows draw the tokens
they draw without speculation.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from ..attention.build import build_kv
from ..config import CacheConfig
from ..kv.cache import KVCacheSpec, dtype_name
from ..kv.groups import KVGroups, plan_groups
from ..quant import kernels as qk
from ..sampling.sampler import greedy_ids
from .block_manager import BlockManager
from .draft_head import DraftHead, resolve_keep
from .draft_weights import lighten
from .model_runner import ModelRunner
from .scheduler import ScheduledSeq
from .sequence import Sequence

logger = logging.getLogger(__name__)

# Catch-ups of up to this many tokens run as decode rows (see _catch_up).
CATCH_UP_ROWS = 8


_FIX = (
    "a draft model must share the target's tokenizer: use a smaller model of the same family "
    "and release (for example SmolLM2-135M for SmolLM2-1.7B), or n-gram speculation"
)


def check_draft_setup(speculative, draft) -> None:
    """Refuse a draft model without its method, or the method without the model (which options
    combine with a draft is EngineConfig.verify's)."""
    if draft is not None and (speculative is None or speculative.method != "draft"):
        raise ValueError("a draft model was given without speculative method 'draft'")
    if draft is None and speculative is not None and speculative.method == "draft":
        raise ValueError("speculative method 'draft' needs the draft model loaded (LLM(...) loads it)")


def check_vocab_size(t_name: str, tv: int, d_name: str, dv: int) -> None:
    """Refuse a draft whose logits cover other token ids than the target's (checked from the
    configs, before either model is loaded)."""
    if tv != dv:
        raise ValueError(
            f"draft model {d_name!r} has a vocabulary of {dv} token ids but the target {t_name!r} has {tv}; {_FIX}"
        )


def check_compatible(target, draft) -> None:
    """Refuse a draft whose proposals would mean other tokens to the target: the vocabulary
    sizes and the token strings behind every id must agree (LoadedModel each)."""
    t_name, d_name = target.source.short_name, draft.source.short_name
    check_vocab_size(t_name, target.config.vocab_size, d_name, draft.config.vocab_size)
    t_vocab = target.tokenizer.backend.get_vocab(with_added_tokens=True)
    d_vocab = draft.tokenizer.backend.get_vocab(with_added_tokens=True)
    if t_vocab != d_vocab:
        t_tok = {i: s for s, i in t_vocab.items()}
        d_tok = {i: s for s, i in d_vocab.items()}
        diff = sorted(i for i in set(t_tok) | set(d_tok) if t_tok.get(i) != d_tok.get(i))
        i = diff[0]
        raise ValueError(
            f"draft model {d_name!r} and the target {t_name!r} tokenize differently: "
            f"{len(diff)} token id(s) differ (id {i} is {t_tok.get(i)!r} in the target, "
            f"{d_tok.get(i)!r} in the draft); {_FIX}"
        )


def draft_cache_config(cache_cfg: CacheConfig) -> CacheConfig:
    """The draft's cache: paged (whatever the target uses), with the target's block size, KV
    dtype and prefix-caching settings."""
    return replace(cache_cfg, paged_attention=True)


def draft_kv_groups(loaded) -> KVGroups:
    """The draft's KV groups: paged attention always, so sliding layers get their own tables."""
    cfg = loaded.config
    return plan_groups(cfg.layer_windows, cfg.num_layers, hybrid=True)


def shared_pool_note(num_blocks: int, target: KVCacheSpec, draft: KVCacheSpec) -> str:
    """What the cache plan's source says of the pool both models draw from."""
    return (
        f"; one pool of {num_blocks - 1} blocks for the target and the draft model, each block id a "
        f"page in both caches ({target.bytes_per_block / 1024:g} + {draft.bytes_per_block / 1024:g} KiB), "
        f"the draft's pages {_mb(num_blocks, draft):.1f} MB of it"
    )


def _mb(num_blocks: int, spec: KVCacheSpec) -> float:
    return (num_blocks * spec.bytes_per_block + spec.fixed_bytes) / 2**20


@dataclass
class _Shadow:
    seq: Sequence  # the draft's view: tokens it holds K/V for (+ pending), its block tables
    synced: int  # the target's length at the last sync: seq.token_ids[:synced] are the target's

    def kept(self, toks: list[int]) -> int:
        """How many of the target's tokens `toks` the draft's computed K/V still holds: those
        synced before, the proposals the target took, never past what it has computed."""
        mine, c = self.seq.token_ids, self.synced
        top = min(len(mine), len(toks))
        while c < top and mine[c] == toks[c]:
            c += 1
        return min(c, self.seq.num_computed_tokens)


class DraftModel:
    """The draft's model, its pages and runner, its KV groups on the target's block pool,
    and a shadow per sequence."""

    def __init__(
        self,
        loaded,
        spec: KVCacheSpec,
        cache_cfg: CacheConfig,
        target: BlockManager,
        device: torch.device,
        dtype: torch.dtype,
        chunk: int,
        draft_vocab: int | None = None,
        draft_weights: str = "file",
    ) -> None:
        """`target`: the target's block manager, whose pool the draft's groups join.
        `draft_vocab`: the token ids its head scores in full (draft_head.py; 0: all).
        `draft_weights`: the format its quantized weights run in (draft_weights.py)."""
        self.name = loaded.source.short_name
        self.loaded = loaded
        self.weights_note = lighten(loaded.model, draft_weights)  # (before its first forward)
        self.cache_config = dcfg = draft_cache_config(cache_cfg)
        self.kv_groups = draft_kv_groups(loaded)
        self.kv_spec = spec
        self.target = target
        pool = target.pool
        self.kv_cache, backend, copy_fn = build_kv(loaded, spec, dcfg, pool.num_blocks, device, dtype, self.kv_groups)
        # Not a second pool: the draft's tables, hashes and figures over the target's blocks.
        self.block_manager = BlockManager(
            pool.num_blocks,
            dcfg.block_size,
            dcfg.prefix_caching,
            dcfg.prefix_cache_n,
            copy_fn,
            self.kv_groups.windows,
            pool=pool,
        )
        self.runner = ModelRunner(loaded.model, backend, cache_cfg.block_size, device, sampler=None)
        self.chunk = chunk  # most tokens the draft computes in one forward
        self.shadows: dict[int, _Shadow] = {}  # target seq_id -> its shadow
        self.forwards = 0  # draft forward passes, for the trace
        # Forwards of decode rows only, and their seconds: what one more proposal costs (a
        # catch-up prefill, such as the prompt on first use, is paid once, not per proposal).
        self.decode_forwards = 0
        self.decode_s = 0.0
        self.no_room = 0  # times a sequence proposed less for want of free blocks in the pool
        self.head = _draft_head(loaded, draft_vocab, draft_weights)
        logger.info(self.describe())

    @property
    def memory_mb(self) -> float:
        """The ceiling of the draft's pages: one per block id of the pool."""
        return _mb(self.block_manager.num_blocks, self.kv_spec)

    @property
    def committed_mb(self) -> float:
        """What the draft's pages hold now: on the CPU (lazy) the block ids its tables ever held."""
        return self.kv_cache.committed_bytes(self.block_manager.num_touched) / 2**20

    def describe(self) -> str:
        bm = self.block_manager
        prefix = f"{bm.stats.hits} prompt tokens reused" if bm.enable_caching else "off"
        return (
            f"draft model {self.name}: {bm.num_groups} KV group(s) in the target's pool of "
            f"{bm.num_usable_blocks} blocks of {bm.block_size} tokens (one budget; each block id a page "
            f"in both caches, the draft's {self.kv_spec.bytes_per_block / 1024:g} KiB, "
            f"{dtype_name(self.kv_spec.dtype)}: ceiling {self.memory_mb:.1f} MB, committed "
            f"{self.committed_mb:.1f} MB), {bm.num_held_blocks} held for {len(self.shadows)} sequences "
            f"of the pool's {bm.num_used_blocks} in use; prefix cache {prefix}; {self.forwards} draft "
            f"forwards; {self.no_room} times short of draft blocks; {self.describe_head()}; "
            f"{self.weights_note or 'weights as loaded'}"
        )

    def describe_head(self) -> str:
        h = self.head
        if h is None:
            return f"head over all {self.loaded.config.vocab_size} token ids"
        return (
            f"head over token ids below {h.keep} of {h.vocab_size} ({h.parts[0].fmt if h.parts else 'float'}) "
            f"and {h.num_extra} others (added tokens, and the rarer ids its sequences hold)"
        )

    # -- per sequence -------------------------------------------------------
    def release(self, seq: Sequence) -> None:
        """The sequence finished, was aborted or preempted: give back its draft blocks. With
        prefix caching their content stays reusable as the target's does (every slot holds the
        K/V of the token the shadow lists there, accepted or not, so its hashes are true)."""
        sh = self.shadows.pop(seq.seq_id, None)
        if sh is None:
            return
        if self.head is not None:
            self.head.drop(seq.seq_id)
        bm = self.block_manager
        bm.commit_full_blocks(sh.seq)
        mode = "keep" if not seq.is_finished else "drop" if seq.finish_reason in ("abort", "error") else "retain"
        bm.free(sh.seq, mode)
        self.runner.release(sh.seq.seq_id)

    def _sync(self, seq: Sequence) -> _Shadow:
        """The shadow of seq, its tokens made the target's: proposals the target took keep
        their K/V, later slots are trimmed, and the target's new tokens wait to be computed."""
        sh = self.shadows.get(seq.seq_id)
        toks = seq.token_ids
        if sh is None:
            d = Sequence(seq.request_id, [], seq.params)
            d.token_ids = list(toks)
            self.block_manager.match_prefix(d)  # a cached prefix of the draft's own K/V
            self.block_manager.record_admission(d)
            sh = self.shadows[seq.seq_id] = _Shadow(d, len(toks))
            if self.head is not None:
                self.head.hold(seq.seq_id, toks)
            return sh
        d, mine = sh.seq, sh.seq.token_ids
        if self.head is not None:
            self.head.hold(seq.seq_id, toks[sh.synced :])
        c = sh.kept(toks)
        del mine[c:]
        mine.extend(toks[c:])
        sh.synced = len(toks)
        if d.num_computed_tokens > c:
            self.block_manager.rewind(d, c)
        # Hashed blocks lie wholly before c, which later syncs never go below, so a hashed
        # block is never rewritten.
        self.block_manager.commit_full_blocks(d)
        return sh

    def lag(self, seq: Sequence) -> int:
        """Tokens of seq the draft would compute before its next proposal: its catch-up (for a
        sequence it has not seen, the whole prompt: at most that, as its prefix cache may hold
        the start)."""
        sh = self.shadows.get(seq.seq_id)
        return len(seq.token_ids) - (sh.kept(seq.token_ids) if sh is not None else 0)

    def cheap_probe(self, seq: Sequence) -> bool:
        """Whether seq's catch-up runs as decode rows (CATCH_UP_ROWS), in the forward that makes
        its first proposal: then a probe costs what any proposal does."""
        return self.lag(seq) <= CATCH_UP_ROWS

    # -- proposing ------------------------------------------------------------
    def _reserve(self, running: list[Sequence]) -> int:
        """Free blocks the draft leaves in the pool: what the target's running sequences take
        in the next step (a decode's next block, a prefill's next chunk, the step's token
        budget handed out in order as the scheduler does), so speculation never makes the
        scheduler preempt anyone."""
        need, budget = 0, self.chunk
        for s in running:
            n = min(s.num_uncomputed_tokens, budget)
            if n <= 0:
                break
            need += self.target.blocks_needed(s, s.num_computed_tokens + n)
            budget -= n
        return need

    def _room(self, d: Sequence, num_tokens: int, reserve: int) -> bool:
        return self.block_manager.blocks_needed(d, num_tokens) <= self.block_manager.num_free_blocks - reserve

    @torch.inference_mode()
    def propose(self, want: list[tuple[Sequence, int]], running: list[Sequence] = ()) -> None:
        """Set `spec_tokens` to up to k greedy draft tokens on each (sequence, k) of `want`.
        A sequence the pool has no room for (beyond what the `running` sequences' next step
        needs), or whose catch-up exceeds this step's chunk, proposes less or nothing."""
        bm = self.block_manager
        budget = self.chunk
        reserve = self._reserve(running)
        first: list[tuple[ScheduledSeq, Sequence, int]] = []
        for seq, k in want:
            new = seq.seq_id not in self.shadows
            d = self._sync(seq).seq
            take = min(d.num_uncomputed_tokens, budget)
            if take > 0 and d.block_table:
                bm.release_window(d)  # sliding draft layers: only at the synced position
            if take <= 0 or not self._room(d, d.num_computed_tokens + take, reserve):
                if take > 0:
                    self.no_room += 1
                if new:  # the blocks its prefix match took go back to the pool until it runs
                    self.release(seq)
                continue
            bm.grow(d, d.num_computed_tokens + take)
            budget -= take
            first.append((_catch_up(d, take), seq, k))
        if not first:
            return
        first.sort(key=lambda x: not x[0].is_decode)  # the attention backend batches decodes first
        live = [
            (it.seq, seq, k)
            for it, seq, k in first
            if it.seq.num_computed_tokens + it.num_new_tokens == it.seq.num_tokens
        ]
        for (_, seq, _), t in zip(live, self._forward([it for it, _, _ in first])):
            seq.spec_tokens = [t]
        for j in range(1, max((k for _, _, k in live), default=0)):
            batch, kept = [], []
            for x in live:
                d, seq, k = x
                if k <= j:
                    continue
                d.token_ids.append(seq.spec_tokens[-1])  # the previous proposal is the next input
                if not self._room(d, d.num_tokens, reserve):
                    d.token_ids.pop()
                    self.no_room += 1
                    continue
                bm.grow(d, d.num_tokens)
                batch.append(ScheduledSeq(d, 1))
                kept.append(x)
            if not batch:
                break
            live = kept
            for (_, seq, _), t in zip(live, self._forward(batch)):
                seq.spec_tokens.append(t)

    def _forward(self, batch: list[ScheduledSeq]) -> list[int]:
        """One draft forward over the batch (decodes first): the greedy token after each item
        that reaches its sequence's end, in batch order. Computed counts advance."""
        t0 = time.perf_counter()
        rows, end = [], 0
        for it in batch:
            end += it.num_new_tokens
            if it.seq.num_computed_tokens + it.num_new_tokens == it.seq.num_tokens:
                rows.append(end - 1)  # the item's last token: only its logits are needed
        with qk.proposals_only():  # the target verifies them: the fastest kernels, at any width
            plan = self.runner.plan(batch)
            if self.head is None:
                plan.logits_rows = rows
                logits = self.runner.logits(plan)
                out = [] if logits is None else greedy_ids(logits)
            else:  # the final hidden states of those rows, through the draft's own head
                plan.logits_rows, plan.hidden_rows = [], rows
                _, hidden = self.runner.forward(plan)
                out = [] if hidden is None else self.head.greedy(hidden)
        for it in batch:
            it.ran()
        self.forwards += 1
        if all(it.is_decode for it in batch):
            self.decode_forwards += 1
            self.decode_s += time.perf_counter() - t0
        return out


def _draft_head(loaded, draft_vocab: int | None, draft_weights: str) -> DraftHead | None:
    """The draft's head over part of its vocabulary, or None to score every id (a small
    vocabulary, draft_vocab 0, or a head this cannot slice)."""
    vocab = loaded.config.vocab_size
    keep = resolve_keep(draft_vocab, vocab)
    model = loaded.model
    if keep >= vocab or not DraftHead.usable(model):
        return None
    added = list(loaded.tokenizer.backend.get_added_tokens_decoder())
    return DraftHead(model, vocab, keep, added, draft_weights)


def _catch_up(d: Sequence, n: int) -> ScheduledSeq:
    """The draft computes n of d's tokens. A few at the end of the sequence (the target's
    token after a verification, with the last proposal when all were accepted) run as decode
    rows, each over d's blocks like a one-token decode (the runner's form for verification
    rows), so the step stays on the decode path; more run as a prefill chunk."""
    c = d.num_computed_tokens
    if 1 < n <= CATCH_UP_ROWS and c + n == d.num_tokens:
        return ScheduledSeq(d, n, spec_tokens=d.token_ids[c + 1 : c + n])
    return ScheduledSeq(d, n)
