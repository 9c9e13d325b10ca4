"""Prefix caching: a property test of the block manager, and engine outputs with caching on vs off."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm import LLM, SamplingParams
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.input_batch import InputBatch
from pagedllm.engine.sequence import Sequence
from models import build_checkpoint

BS = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 9, 9], [7, 7, 7, 7, 7, 7, 7, 7, 1, 2], [5]]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit / decode / fork / finish / preempt / abort against a shadow of the
    physical cache: every computed slot of a live table must hold that sequence's token."""

    windows: list[int | None] = [None]  # one KV group, global

    def __init__(self) -> None:
        super().__init__()
        self.phys: dict[int, list[int | None]] = {}
        self.bm = BlockManager(
            14 * len(self.windows),
            BS,
            enable_caching=True,
            max_cached_seqs=3,
            copy_fn=self._copy,
            group_windows=self.windows,
        )
        self.live: list[Sequence] = []
        # The runner's persistent rows, starting small so they grow: kept in step with the tables
        # by what the block manager reports (appends, and table_version for the rest).
        self.rows = InputBatch(len(self.windows), rows=2, width=2)

    def _copy(self, src: int, dst: int, n: int) -> None:
        s = self.phys.setdefault(src, [None] * BS)
        d = self.phys.setdefault(dst, [None] * BS)
        d[:n] = s[:n]

    def _compute(self, seq: Sequence, upto: int) -> None:
        for table in self.bm.tables(seq):
            for p in range(seq.num_computed_tokens, upto):
                self.phys.setdefault(table[p // BS], [None] * BS)[p % BS] = seq.token_ids[p]
        seq.num_computed_tokens = upto
        self.bm.commit_full_blocks(seq)
        self.bm.release_window(seq)

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=6))
    def admit(self, prefix, tail):
        seq = Sequence("r", prefix + tail, SamplingParams())
        self.bm.match_prefix(seq)
        self.bm.release_window(seq)
        if not self.bm.can_grow(seq, seq.num_tokens):
            self.bm.free(seq, "keep")
            return
        self.bm.record_admission(seq)
        self.bm.grow(seq, seq.num_tokens)
        self._compute(seq, seq.num_tokens)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), tok=st.integers(0, 3))
    def decode(self, i, tok):
        seq = self.live[i % len(self.live)]
        seq.append_token(tok)
        if not self.bm.can_grow(seq, seq.num_tokens):
            self.bm.free(seq, "keep")  # preempted for lack of blocks
            self.live.remove(seq)
            self.rows.release(seq.seq_id)
            return
        self.bm.grow(seq, seq.num_tokens)
        self._compute(seq, seq.num_tokens)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def fork(self, i):
        parent = self.live[i % len(self.live)]
        child = Sequence("r", list(parent.token_ids), SamplingParams())
        self.bm.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), mode=st.sampled_from(["retain", "keep", "drop"]))
    def release(self, i, mode):
        seq = self.live.pop(i % len(self.live))
        self.bm.free(seq, mode)
        self.rows.release(seq.seq_id)

    @invariant()
    def rows_match_tables(self):
        for seq in self.live:
            r = self.rows.row(seq)
            for g, table in enumerate(self.bm.tables(seq)):
                row = self.rows.tables[g, r]
                assert row[: len(table)].tolist() == table and not row[len(table) :].any(), (g, row, table)
            assert seq.num_released == sum(t.count(0) for t in self.bm.tables(seq))

    @invariant()
    def blocks_consistent(self):
        self.bm.check_invariants(self.live)
        assert len(self.bm.retained) <= 3
        for seq in self.live:
            for table, w in zip(self.bm.tables(seq), self.windows):
                assert len(table) >= -(-seq.num_computed_tokens // BS)
                # A sliding group must still hold the window its next query reads.
                first = 0 if w is None else max(0, seq.num_computed_tokens - w + 1)
                for p in range(first, seq.num_computed_tokens):
                    got = self.phys[table[p // BS]][p % BS]
                    assert got == seq.token_ids[p], f"slot {p} holds {got}, expected {seq.token_ids[p]}"

    def teardown(self):
        for seq in self.live:
            self.bm.free(seq, "retain")
        self.bm.check_invariants([])
        assert self.bm.num_used_blocks == 0


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class HybridBlockManagerMachine(BlockManagerMachine):
    """The same with a global and a sliding KV group (Gemma-like): one pool, two tables per
    sequence, the sliding one released behind its window of 6 tokens."""

    windows = [None, 6]


TestHybridBlockManagerMachine = HybridBlockManagerMachine.TestCase
TestHybridBlockManagerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


# -- engine level, on a random-weight Llama ---------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, hf_smollm2_tokenizer):
    tok = hf_smollm2_tokenizer
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama-pc"), tok, len(tok))


def _llm(path, **kw):
    return LLM(str(path), dtype="float32", kv_cache_memory_mb=kw.pop("mb", 32), **kw)


def _assert_clean(llm):
    eng = llm.engine
    assert not eng.requests and not eng.scheduler.has_unfinished()
    assert eng.block_manager.num_used_blocks == 0
    eng.block_manager.check_invariants([])


def _multi_turn(llm, n_convs=3, turns=6, sampled=False):
    """n_convs conversations advanced together, turn by turn; returns every answer."""
    convs = [[{"role": "system", "content": f"You are assistant number {c}."}] for c in range(n_convs)]
    answers = []
    for t in range(turns):
        for c in convs:
            c.append({"role": "user", "content": f"Turn {t}: tell me about topic {t * 7 + len(c)}."})
        sp = [
            SamplingParams(
                max_tokens=20, temperature=0.8 if sampled else 0.0, seed=(100 + i) if sampled else None, ignore_eos=True
            )
            for i in range(n_convs)
        ]
        prompts = [llm.tokenizer.apply_chat_template(c, tokenize=True) for c in convs]
        outs = llm.generate(prompts, sp, use_tqdm=False)
        for c, o in zip(convs, outs):
            c.append({"role": "assistant", "content": o.text})
            answers.append((o.token_ids, o.num_cached_tokens, len(o.prompt_token_ids)))
    return answers


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [False, True])
def test_multi_turn_same_with_and_without_cache(ckpt, sampled):
    on, off = _llm(ckpt), _llm(ckpt, enable_prefix_caching=False)
    a_on, a_off = _multi_turn(on, sampled=sampled), _multi_turn(off, sampled=sampled)
    assert [a[0] for a in a_on] == [a[0] for a in a_off]
    # Later turns are served mostly from the cache; with caching off nothing is.
    last = a_on[-3:]
    assert all(cached >= 0.8 * plen for _, cached, plen in last), last
    assert all(cached == 0 for _, cached, _ in a_off)
    _assert_clean(on)
    _assert_clean(off)


@pytest.mark.slow
def test_shared_system_prompt_32_requests(ckpt):
    system = "You are a careful assistant. " * 30
    msgs = [[{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}] for i in range(32)]
    on, off = _llm(ckpt), _llm(ckpt, enable_prefix_caching=False)
    sp = [SamplingParams(max_tokens=12, temperature=0.7, seed=i, ignore_eos=True) for i in range(32)]
    prompts = [on.tokenizer.apply_chat_template(m, tokenize=True) for m in msgs]
    o_on = on.generate(prompts, sp, use_tqdm=False)
    o_off = off.generate(prompts, sp, use_tqdm=False)
    assert [o.token_ids for o in o_on] == [o.token_ids for o in o_off]
    assert on.engine.block_manager.stats.hits > 0
    _assert_clean(on)


def test_n4_shares_prompt_and_equals_separate_requests(ckpt):
    llm = _llm(ckpt)
    prompt = list(range(1000, 1100))  # 100 tokens: 3 full blocks + a shared partial one
    sp = SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    eng = llm.engine
    eng.add_request(prompt, sp, request_id="fork")
    eng.step()  # prefill once, sample 4 first tokens, fork
    seqs = eng.requests["fork"].seqs
    assert all(s.block_table == seqs[0].block_table for s in seqs)  # the prompt is held once
    assert all(eng.block_manager.blocks[b].ref_count == 4 for b in seqs[0].block_table)
    outs = [o for o in eng.step() if o.finished]  # first decode writes into the partial block
    tables = [s.block_table for s in seqs]
    assert all(t[:3] == tables[0][:3] for t in tables)
    assert all(eng.block_manager.blocks[b].ref_count == 4 for b in tables[0][:3])
    held = {b for t in tables for b in t}
    assert len(held) == 3 + 4  # full prompt blocks once; the partial one copied on write
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.finished]
    forked = [c.token_ids for c in outs[0].outputs]
    separate = [
        llm.generate(
            [prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=7 + i, ignore_eos=True), use_tqdm=False
        )[0].token_ids
        for i in range(4)
    ]
    assert forked == separate
    assert len(set(map(tuple, forked))) > 1
    _assert_clean(llm)


def test_eviction_and_preemption_keep_outputs(ckpt):
    big = _llm(ckpt, mb=32)
    # 48 blocks of 8: far less than 12 sequences of up to ~170 tokens need together.
    small = LLM(
        str(ckpt), dtype="float32", block_size=8, kv_cache_context_len=384, max_num_batched_tokens=64, prefix_cache_n=4
    )
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 40000, (60,), generator=g).tolist()
    prompts = [
        shared + torch.randint(0, 40000, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 90, (12,), generator=g)
    ]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in big.generate(prompts, sp, use_tqdm=False)]
    got = [o.token_ids for o in small.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    eng = small.engine
    assert eng.scheduler.num_preemptions > 0
    assert eng.block_manager.stats.evictions > 0
    _assert_clean(small)
    assert len(eng.block_manager.retained) <= 4


def test_waste_counts_only_computed_tokens(ckpt):
    """Waste is allocated slots not holding a token. A prompt prefilled in chunks holds
    blocks for its chunks so far, so its not-yet-computed tokens must not count as held."""
    llm = _llm(ckpt, block_size=16, max_num_batched_tokens=40)
    eng = llm.engine
    eng.add_request(list(range(2000, 2100)), SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()  # one 40-token chunk of the 100-token prompt: 3 blocks, 48 slots, 40 held
    tr = llm.kv_cache_trace()
    assert eng.scheduler.running[0].block_table and len(eng.scheduler.running[0].block_table) == 3
    assert tr.waste == pytest.approx(8 / 48) and tr.waste_avg == pytest.approx(8 / 48)
    while eng.has_unfinished():
        eng.step()
    # Then 40 + 20 more prompt tokens, then 3 decodes: every later step had some waste too.
    assert 0 < llm.kv_cache_trace().waste_avg < 8 / 48
    _assert_clean(llm)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_multi_turn_sliding_window_models(tmp_path, hf_smollm2_tokenizer, family):
    """Sliding windows (48 tokens, shorter than every later turn): Mistral releases blocks
    behind the window and reuses a prefix where the window before its end is cached; Gemma 3's
    global layers keep every block. Either way caching changes no token."""
    tok = hf_smollm2_tokenizer
    path = build_checkpoint(family, tmp_path / family, tok, len(tok))
    on, off = _llm(path, block_size=16), _llm(path, block_size=16, enable_prefix_caching=False)
    a_on, a_off = _multi_turn(on), _multi_turn(off)
    assert [a[0] for a in a_on] == [a[0] for a in a_off]
    last = a_on[-3:]  # turn 6 of each conversation
    share = sum(c for _, c, _ in last) / sum(p for _, _, p in last)
    print(f"{family}: turn 6 cached share {share:.3f} ({[(c, p) for _, c, p in last]})")
    assert all(p > 48 for _, _, p in last) and share >= 0.8, last
    assert all(cached == 0 for _, cached, _ in a_off)
    _assert_clean(on)
    _assert_clean(off)


def test_sliding_window_match_needs_only_the_window():
    """Window 8, blocks of 4: a prompt reuses the cached chain up to its furthest full block
    whose two preceding blocks are cached, even after the blocks before them were evicted;
    the entries before the window stay null and are never held."""
    bm = BlockManager(
        12, BS, enable_caching=True, max_cached_seqs=4, group_windows=[8], copy_fn=lambda src, dst, n: None
    )
    first = Sequence("a", list(range(1, 26)), SamplingParams())  # 6 full blocks + 1 token
    bm.match_prefix(first)
    bm.grow(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    bm.commit_full_blocks(first)
    table = list(first.block_table)
    bm.free(first, "retain")
    for bid in table[:3]:  # evict the oldest blocks: the cache holds blocks 3.. of the chain
        bm._unretain(bid)
    bm.check_invariants([])
    again = Sequence("b", list(range(1, 26)) + [99], SamplingParams())
    bm.match_prefix(again)
    assert again.block_table[:4] == [0, 0, 0, 0] and again.block_table[4:6] == table[4:6]
    assert again.num_computed_tokens == 25  # 6 full blocks + the cached tail token
    bm.check_invariants([again])
    plain = BlockManager(12, BS, enable_caching=True)  # no window: a hole ends the match
    seq = Sequence("c", list(range(1, 26)), SamplingParams())
    plain.match_prefix(seq)
    assert seq.num_computed_tokens == 0


def test_a_hash_collision_between_chains_is_not_served(monkeypatch):
    """Force every block with the same tokens to one hash, whatever came before it (a 64-bit
    collision of two chains, made certain): the block after C must not be served from the chain
    A, B although B's tokens and hash match, because its parent is A, not C."""
    from pagedllm.engine import block_manager as bmod

    monkeypatch.setattr(bmod, "block_hash", lambda parent, tokens, extra=None: hash((tokens, extra)))
    bm = BlockManager(12, BS, enable_caching=True, max_cached_seqs=4, copy_fn=lambda src, dst, n: None)
    a, b, c, d = [1, 2, 3, 4], [5, 6, 7, 8], [11, 12, 13, 14], [15, 16, 17, 18]
    for i, ids in enumerate((a + b + [9], c + d + [9])):
        seq = Sequence(str(i), ids, SamplingParams())
        bm.match_prefix(seq)
        bm.grow(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        bm.commit_full_blocks(seq)
        bm.free(seq, "retain")
    ab_tail = bm.by_hash[bmod.block_hash(0, tuple(b))]
    assert bm.blocks[ab_tail].tokens == tuple(b)  # the collision is real: C, B's second block maps here
    q = Sequence("q", c + b + [9], SamplingParams())
    bm.match_prefix(q)
    assert ab_tail not in q.block_table
    assert q.num_computed_tokens == 4  # block C only; B after C is computed afresh
    bm.check_invariants([q])


def test_prefix_cache_n_0_turns_caching_off_in_python_as_on_the_cli(ckpt):
    """`--prefix-cache-n 0` turns prefix caching off on the CLI; `LLM(prefix_cache_n=0)` must mean
    the same, not "cache, but keep no finished prefixes"."""
    from pagedllm.config import EngineConfig

    assert EngineConfig.from_kwargs(model=str(ckpt), prefix_cache_n=0).cache.prefix_caching is False
    prompt = list(range(100, 180))  # two full blocks and more of a shared prefix
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    on, off = _llm(ckpt), _llm(ckpt, prefix_cache_n=0)
    for llm in (on, off):
        llm.generate([prompt], sp, use_tqdm=False)
    assert on.generate([prompt], sp, use_tqdm=False)[0].num_cached_tokens > 0
    assert not off.engine.prefix_caching and "prefix_cache_n=0" in off.engine.prefix_caching_note
    # Two requests running at once could share blocks through an enabled cache: not through this one.
    outs = off.generate([prompt, prompt], sp, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert off.engine.block_manager.num_cached_blocks == 0
    _assert_clean(off)
