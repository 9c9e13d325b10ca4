"""Prompt scoring (prompt_logprobs, echo) is scheduled work: a long scored prompt is prefilled in
chunks beside the running streams' decodes, within the step's token budget, instead of one
whole prefill that stops every other stream while it runs."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from models import build_checkpoint

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

BUDGET = 256  # max_num_batched_tokens
PROMPT = 2000  # tokens of the scored prompt
STREAMS = 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory, hf_smollm2_tokenizer):
    """A random-weight llama with room for the 2,000-token prompt, and transformers' copy of it."""
    import transformers as tf

    tok = hf_smollm2_tokenizer
    path = build_checkpoint(
        "llama", tmp_path_factory.mktemp("llama-score"), tok, len(tok), max_position_embeddings=4096
    )
    return path, tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _run(path, scored: list[int] | None):
    """8 greedy streams decode; once all are decoding, the scored prompt (if any) arrives.
    Per step: the tokens the model computed since the previous step ended (a prefill run
    outside the step counts toward the next one) and the streams that got a token; per stream,
    the wall-clock gaps between its tokens."""
    llm = LLM(
        str(path),
        dtype="float32",
        max_num_batched_tokens=BUDGET,
        max_model_len=4096,
        kv_cache_memory_mb=32,
        enable_prefix_caching=False,
    )
    eng = llm.engine
    computed = []
    forward = eng.model.forward

    def counting(input_ids, *a, **kw):
        computed.append(input_ids.numel())
        return forward(input_ids, *a, **kw)

    eng.model.forward = counting
    g = torch.Generator().manual_seed(3)
    vocab = eng.model_config.vocab_size
    for i in range(STREAMS):
        eng.add_request(
            torch.randint(0, vocab, (12,), generator=g).tolist(),
            SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
            request_id=f"d{i}",
        )
    last = {f"d{i}": None for i in range(STREAMS)}
    gaps = {rid: [] for rid in last}
    steps = []  # (tokens computed, ids of the streams that got a token, the scored request finished)
    result = None
    while eng.has_unfinished():
        done = len(computed)  # a prefill run inside add_request counts toward the next step
        if scored is not None and len(steps) == 3:
            eng.add_request(scored, SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0), request_id="score")
            scoring_from = len(steps)
        outs = eng.step()
        now = time.perf_counter()
        got = set()
        for o in outs:
            if o.request_id == "score":
                if o.finished:
                    result = o
                continue
            got.add(o.request_id)
            if last[o.request_id] is not None:
                gaps[o.request_id].append(now - last[o.request_id])
            last[o.request_id] = now
        steps.append((sum(computed[done:]), got, result is not None))
    itl = np.array([x for v in gaps.values() for x in v])
    return steps, (scoring_from if scored is not None else None), result, float(np.percentile(itl, 99))


def test_long_prompt_logprobs_is_chunked_with_the_decodes(llama, capsys):
    path, ref_model = llama
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, ref_model.config.vocab_size, (PROMPT,), generator=g).tolist()

    base_steps, _, _, base_p99 = _run(path, None)
    steps, first, out, p99 = _run(path, prompt)
    assert out is not None and len(out.prompt_logprobs) == PROMPT

    # From the step after the request arrived until the one that completed its prompt: no step
    # (with whatever ran before it since the previous step) computes more than the budget, and
    # every stream gets its token in each of them.
    scoring = []
    for computed, got, finished in steps[first:]:
        scoring.append(computed)
        assert computed <= BUDGET, f"{computed} tokens computed between two decode steps (budget {BUDGET})"
        assert got == {f"d{i}" for i in range(STREAMS)}, f"only {sorted(got)} decoded this step"
        if finished:
            break
    # the prompt took as many steps as budget minus the decodes allows
    assert len(scoring) >= -(-PROMPT // (BUDGET - STREAMS))
    with capsys.disabled():
        print(
            f"\n8 streams, p99 inter-token latency: {1e3 * base_p99:.1f} ms alone, {1e3 * p99:.1f} ms with a "
            f"{PROMPT}-token prompt_logprobs request; largest step {max(scoring)} tokens "
            f"(budget {BUDGET}, alone {max(c for c, _, _ in base_steps)}), {len(scoring)} steps to score it"
        )

    # The entries are transformers' log-softmax at every prompt position.
    with torch.no_grad():
        lsm = torch.log_softmax(ref_model(torch.tensor([prompt])).logits[0].float(), -1)
    want = lsm[torch.arange(PROMPT - 1), torch.tensor(prompt[1:])]
    lp = out.prompt_logprobs
    assert lp[0] is None
    got = torch.tensor([lp[j][prompt[j]] for j in range(1, PROMPT)])
    assert (got - want).abs().max().item() < 1e-3
    top = lsm[:-1].topk(2, dim=-1).indices
    agree = sum(set(top[j - 1].tolist()) <= set(lp[j]) for j in range(1, PROMPT))
    assert agree >= 0.99 * (PROMPT - 1)


# -- offline scoring (LLM.prompt_logits, LLM.score_prompts) is the engine's own scheduled requests --


def _record_schedule(eng) -> list[list[tuple[str, int]]]:
    """Each step's scheduled (request id, tokens) pairs, as the scheduler decided them."""
    steps: list[list[tuple[str, int]]] = []
    schedule = eng.scheduler.schedule

    def recording():
        out = schedule()
        steps.append([(it.seq.request_id, it.num_new_tokens) for it in out.scheduled])
        return out

    eng.scheduler.schedule = recording
    return steps


def _ref_logits(ref_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref_model(torch.tensor([prompt])).logits[0].float()


def test_offline_scoring_is_scheduled_at_its_chunk_size(llama):
    """Each prompt is a request the scheduler runs, at most chunk_size of its tokens a step
    (1: token by token), all prompts advancing together; the values are transformers'."""
    path, ref_model = llama
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16, max_num_batched_tokens=BUDGET)
    steps = _record_schedule(llm.engine)
    g = torch.Generator().manual_seed(5)
    vocab = ref_model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (37, 20)]

    top1: list[torch.Tensor] = []
    lps = llm.score_prompts(prompts, chunk_size=1, top1=top1)
    # one token of each unfinished prompt per step, the two prompts in the same steps
    assert [sorted(n for _, n in s) for s in steps] == [[1, 1]] * 20 + [[1]] * 17
    for p, lp, t1 in zip(prompts, lps, top1):
        want = _ref_logits(ref_model, p)[:-1]
        lsm = want.log_softmax(-1)
        assert lp.dtype == torch.float32 and lp.shape == (len(p) - 1,)
        assert (lp - lsm.gather(1, torch.tensor(p[1:])[:, None])[:, 0]).abs().max().item() < 1e-4
        assert t1.dtype == torch.int64 and (t1 == want.argmax(-1)).double().mean().item() >= 0.95

    steps.clear()
    lps8 = llm.score_prompts(prompts, chunk_size=8)
    assert [sorted(n for _, n in s) for s in steps] == [[8, 8], [8, 8], [4, 8], [8], [5]]
    for a, b in zip(lps8, lps):
        assert (a - b).abs().max().item() < 1e-4

    steps.clear()
    logits = llm.prompt_logits(prompts[0], chunk_size=10)
    assert [n for s in steps for _, n in s] == [10, 10, 10, 7]
    want = _ref_logits(ref_model, prompts[0])
    assert logits.shape == want.shape and logits.dtype == torch.float32
    assert (logits - want).abs().max().item() < 1e-4
    steps.clear()
    whole = llm.prompt_logits(prompts[0])  # None: the step's budget, here the whole prompt at once
    assert [n for s in steps for _, n in s] == [37]
    assert (whole - want).abs().max().item() < 1e-4


def test_offline_scoring_leaves_nothing_behind(llama):
    """The scoring requests return every block, keep no prefix, free their runner rows and hold
    no sampler state; a generation running meanwhile decodes in the same steps, unchanged."""
    path, ref_model = llama
    kw = dict(dtype="float32", kv_cache_memory_mb=16, max_num_batched_tokens=BUDGET)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    gen_prompt = list(range(100, 130))
    [alone] = LLM(str(path), **kw).generate([gen_prompt], sp, use_tqdm=False)

    llm = LLM(str(path), **kw)
    eng, bm = llm.engine, llm.engine.block_manager
    llm.generate([list(range(200, 260))], SamplingParams(max_tokens=3), use_tqdm=False)  # a kept prefix
    retained = list(bm.retained)
    assert bm.num_used_blocks == 0 and len(retained) == 1
    [rid] = llm.driver.add([(None, gen_prompt, sp)])
    gen = eng.requests[rid].seqs[0]
    llm.driver.advance()
    steps = _record_schedule(eng)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, ref_model.config.vocab_size, (n,), generator=g).tolist() for n in (50, 33)]
    llm.score_prompts(prompts, chunk_size=4, top1=[])
    assert len(steps) == 13 and all(rid in {r for r, _ in s} for s in steps)  # decoding beside them
    # Only the generation holds blocks, a runner row and penalty state; the scoring kept no prefix.
    assert bm.num_used_blocks == len(gen.block_table) > 0
    assert list(eng.runner.batch.row_of) == [gen.seq_id]
    assert list(eng.runner.sampler.penalties.slots) == [gen.seq_id]
    assert list(bm.retained) == retained
    [out] = llm.driver.finals([rid])
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids

    retained, cached = list(bm.retained), bm.num_cached_blocks
    assert retained[-1] == gen.seq_id
    llm.prompt_logits(prompts[0], chunk_size=3)
    assert (bm.num_used_blocks, bm.num_cached_blocks, list(bm.retained)) == (0, cached, retained)
    assert not eng.runner.batch.row_of and not eng.runner.sampler.penalties.slots
    assert not eng.requests and not eng.scheduler.has_unfinished()
    bm.check_invariants([])


def test_offline_scoring_queues_what_the_cache_cannot_hold(llama):
    """More prompts than the KV cache holds at once wait for room (no error) and score as each
    does alone; a prompt past max_model_len is refused clearly, and nothing is left added."""
    path, ref_model = llama
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=16,
        kv_cache_context_len=256,
        max_model_len=200,
        max_num_batched_tokens=BUDGET,
    )
    eng = llm.engine
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, ref_model.config.vocab_size, (150,), generator=g).tolist() for _ in range(4)]
    assert 4 * 150 > eng.block_manager.num_usable_blocks * 16  # they cannot all be held at once
    together = llm.score_prompts(prompts, chunk_size=32)
    for p, lp in zip(prompts, together):
        lsm = _ref_logits(ref_model, p)[:-1].log_softmax(-1)
        assert (lp - lsm.gather(1, torch.tensor(p[1:])[:, None])[:, 0]).abs().max().item() < 1e-4
    assert eng.block_manager.num_used_blocks == 0 and not eng.requests

    with pytest.raises(ValueError, match="max_model_len is 200"):
        llm.score_prompts([prompts[0], prompts[1] + prompts[2]])
    with pytest.raises(ValueError, match="max_model_len is 200"):
        llm.prompt_logits(prompts[1] + prompts[2])
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        llm.score_prompts([prompts[0]], chunk_size=0)
    assert eng.block_manager.num_used_blocks == 0 and not eng.requests and not eng.scheduler.has_unfinished()
