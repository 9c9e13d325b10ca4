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

BUDGET = 256  # max_num_batched_tokens
PROMPT = 2000  # tokens of the scored prompt
STREAMS = 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory, hf_smollm2_tokenizer):
    """A random-weight llama with room for the 2,000-token prompt, and transformers' copy of it."""
    import transformers as tf

    tok = hf_smollm2_tokenizer
    path = build_checkpoint("llama", tmp_path_factory.mktemp("llama-score"), tok, len(tok),
                            max_position_embeddings=4096)
    return path, tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _run(path, scored: list[int] | None):
    """8 greedy streams decode; once all are decoding, the scored prompt (if any) arrives.
    Per step: the tokens the model computed since the previous step ended (a prefill run
    outside the step counts toward the next one) and the streams that got a token; per stream,
    the wall-clock gaps between its tokens."""
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=BUDGET, max_model_len=4096,
              kv_cache_memory_mb=32, enable_prefix_caching=False)
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
        eng.add_request(torch.randint(0, vocab, (12,), generator=g).tolist(),
                        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), request_id=f"d{i}")
    last = {f"d{i}": None for i in range(STREAMS)}
    gaps = {rid: [] for rid in last}
    steps = []  # (tokens computed, ids of the streams that got a token, the scored request finished)
    result = None
    while eng.has_unfinished():
        done = len(computed)  # a prefill run inside add_request counts toward the next step
        if scored is not None and len(steps) == 3:
            eng.add_request(scored, SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0),
                            request_id="score")
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
        print(f"\n8 streams, p99 inter-token latency: {1e3 * base_p99:.1f} ms alone, {1e3 * p99:.1f} ms with a "
              f"{PROMPT}-token prompt_logprobs request; largest step {max(scoring)} tokens "
              f"(budget {BUDGET}, alone {max(c for c, _, _ in base_steps)}), {len(scoring)} steps to score it")

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
