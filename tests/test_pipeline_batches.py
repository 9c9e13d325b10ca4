"""Pipeline parallelism's micro-batches (engine/llm_engine.py `_step_pipelined`, the scheduler's
`schedule_disjoint`): with P stages up to P steps of disjoint sequences are in flight, so each
stage works on one while the others work on the rest. A sequence in flight is not scheduled
again, not preempted, and keeps its blocks until its step returns; an abort of it takes effect
then. Greedy tokens stay pp=1's (and transformers') with preemption, prefix caching, n=4,
chunked prefill and n-gram speculation in the run."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import SchedulerConfig
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence
from pagedllm.sampling.params import SamplingParams as SP


def _seq(n: int) -> Sequence:
    return Sequence("r", list(range(1, n + 1)), SP(max_tokens=100))


def test_a_busy_sequence_is_neither_scheduled_nor_preempted():
    bm = BlockManager(6, 4)  # 5 usable (block 0 is the null block)
    sch = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), bm)
    a, b, c = _seq(8), _seq(7), _seq(3)
    for s in (a, b, c):
        sch.add(s)
    first = sch.schedule()
    assert [it.seq for it in first.scheduled] == [a, b, c]  # 2 + 2 + 1: every block
    sch.update(first)
    for s in (a, b, c):
        s.append_token(9)
    # b is in flight; a's decode needs a block (its 8 tokens fill two, the 9th a third) and none
    # is free: the newest not in flight, c, is preempted, never b.
    out = sch.schedule_disjoint({b.seq_id}, cap=8)
    assert [it.seq for it in out.scheduled] == [a] and out.preempted == [c]
    assert sch.running == [a, b] and b.block_table and sch.waiting[0] is c
    # The running set splits by `cap`: two not in flight, at most one a step.
    sch2 = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), BlockManager(32, 4))
    seqs = [_seq(3) for _ in range(4)]
    for s in seqs:
        sch2.add(s)
    one = sch2.schedule_disjoint(set(), cap=2)
    two = sch2.schedule_disjoint({it.seq.seq_id for it in one.scheduled}, cap=2)
    assert [it.seq for it in one.scheduled] == seqs[:2] and [it.seq for it in two.scheduled] == seqs[2:]
    assert sch2.running == seqs


def test_micro_batches_share_a_long_prefill_evenly():
    """Eight 40-token prompts (320 tokens) at 128 tokens a step, two steps in flight: the
    prompts are cut into four steps of 80 tokens, in pairs, not 128, 128 and a short 64 beside
    which the other stage would wait; then decodes join the next pair's prompt chunks."""
    sch = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=64), BlockManager(128, 4))
    seqs = [_seq(40) for _ in range(8)]
    for s in seqs:
        sch.add(s)
    assert sch.tokens_to_compute(set()) == (320, 0, 8)

    def prompt_tokens(out):
        return sum(it.num_new_tokens for it in out.scheduled if not it.is_decode)

    one = sch.schedule_micro_batch(set(), places=2, micro_batches=2)
    busy = {it.seq.seq_id for it in one.scheduled}
    two = sch.schedule_micro_batch(busy, places=1, micro_batches=2, pair_with=prompt_tokens(one))
    assert [prompt_tokens(s) for s in (one, two)] == [80, 80]
    # The first step returns: its two sequences decode beside the next 80 prompt tokens.
    sch.update(one)
    for it in one.scheduled:
        it.seq.append_token(9)
    busy = {it.seq.seq_id for it in two.scheduled}
    assert sch.tokens_to_compute(busy) == (160, 2, 4)
    three = sch.schedule_micro_batch(busy, places=1, micro_batches=2, pair_with=prompt_tokens(two))
    assert prompt_tokens(three) == 80 and sum(it.is_decode for it in three.scheduled) == 2


@pytest.mark.parametrize(
    "lens, want",
    [
        ([100] * 8, [200, 200]),  # within one step's budget, still cut in chunks of about 256 tokens, in pairs
        ([1000], [1000]),  # one sequence's prompt: not cut (its chunks could only follow one another)
        ([1000, 1000], [1000, 1000]),  # one prompt a step, side by side
    ],
)
def test_micro_batch_prompt_chunks(lens, want):
    sch = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=1100), BlockManager(600, 16)
    )
    for n in lens:
        sch.add(_seq(n))
    got, busy, newest = [], set(), 0
    for places in (2, 1):
        out = sch.schedule_micro_batch(busy, places=places, micro_batches=2, pair_with=newest)
        newest = sum(it.num_new_tokens for it in out.scheduled)
        busy |= {it.seq.seq_id for it in out.scheduled}
        if out.scheduled:
            got.append(newest)
    assert got == want


PROMPT_LENS = [1, 17, 64, 150, 300, 9, 33, 80]
NEW = 24
KW = dict(dtype="float32", block_size=16, kv_cache_context_len=400, max_num_batched_tokens=64)


def _workload(llm, prompts):
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    # Two turns of a chat, the second reusing the first's blocks (prefix caching), beside a third.
    turn = prompts[4][:120]
    turns = llm.generate([turn, prompts[6]], greedy, use_tqdm=False)
    again = llm.generate([turn + turns[0].token_ids + prompts[5], prompts[7]], greedy, use_tqdm=False)
    chat = [o.token_ids for o in turns + again] + [again[0].num_cached_tokens]
    forks = llm.generate(
        [prompts[1]], SamplingParams(n=4, max_tokens=NEW, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    return got, chat, [c.token_ids for c in forks.outputs]


@pytest.mark.slow
def test_micro_batches_in_flight_give_pp1s_tokens(tmp_path, hf_smollm2_tokenizer):
    from models import reference_family

    path, _, prompts, want = reference_family(
        "llama", tmp_path / "llama", hf_smollm2_tokenizer, PROMPT_LENS, NEW, seed=7
    )
    with LLM(str(path), pipeline_parallel_size=2, **KW) as llm:
        eng = llm.engine
        got = _workload(llm, prompts)
        assert eng.max_in_flight == 2  # two steps in flight at once: one a stage
        assert eng.scheduler.num_preemptions > 0
        assert got[1][-1] >= 120 // 16 * 16  # the second turn's prompt found the first's blocks
        assert not eng.in_flight and not eng.busy
        bm = eng.block_manager
        assert bm.num_free_blocks == bm.num_usable_blocks

        # An abort of a request whose step is in flight takes effect when the step returns.
        greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        keep = eng.add_request(prompts[3], greedy)
        gone = eng.add_request(prompts[4], greedy)
        outs = []

        def in_flight() -> set[str]:
            return {it.seq.request_id for sched, _ in eng.in_flight for it in sched.scheduled}

        for _ in range(20):  # (a step leaves at most P - 1 steps in flight, the oldest collected)
            if gone in in_flight():
                break
            outs += eng.step()
        assert gone in in_flight()
        seq = next(s for s in eng.scheduler.running if s.request_id == gone)
        assert eng.abort(gone)
        assert seq.block_table and seq in eng.scheduler.running  # held until its step returns
        while eng.has_unfinished():
            outs += eng.step()
        assert all(o.request_id == keep for o in outs)
        assert [o for o in outs if o.finished][0].outputs[0].token_ids == want[3]
        assert seq not in eng.scheduler.running and not seq.block_table
        assert bm.num_free_blocks == bm.num_usable_blocks

    assert got[0] == want
    one = LLM(str(path), **KW)
    assert _workload(one, prompts) == got
    assert got[2] == [want[1]] * 4


@pytest.mark.slow
def test_ngram_speculation_under_micro_batches(tmp_path, hf_smollm2_tokenizer):
    """N-gram proposals made for sequences between their steps (never for one in flight),
    verified in micro-batches: plain pp=1 decoding's greedy tokens. (A vocabulary of 256 makes
    a random model's output repeat, so proposals are made, accepted and rejected.)"""
    from models import build_checkpoint
    from test_speculative import NGRAM, RANDOM_VOCAB, _prompts

    path = build_checkpoint("llama", tmp_path / "m", hf_smollm2_tokenizer, RANDOM_VOCAB)
    prompts = _prompts(RANDOM_VOCAB) * 2
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", block_size=16, kv_cache_context_len=1024, max_num_batched_tokens=64)
    with LLM(str(path), pipeline_parallel_size=2, speculative=NGRAM, **kw) as llm:
        got = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        st = llm.engine.spec.stats
        assert llm.engine.max_in_flight == 2
        assert st.proposed > st.accepted > 0, st
    want = [o.token_ids for o in LLM(str(path), **kw).generate(prompts, greedy, use_tqdm=False)]
    assert got == want
