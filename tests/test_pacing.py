"""A short request beside a long prefill (issue 78, point 4): with pacing on, prompts are shared
shortest-first, and while a sequence decodes the pacer (engine/pacing.py) keeps the long prompt's chunks small
enough that the stream's tokens keep coming. Speed itself is `pagedllm bench interleave`'s."""

from __future__ import annotations

import pytest

from pagedllm.engine.pacing import PrefillPacer
from pagedllm.sampling.params import SamplingParams


def test_pacer_steers_the_prompt_limit_by_the_steps_times():
    pacer = PrefillPacer(factor=2.5, floor=4)
    assert pacer.prompt_budget() == 4  # nothing measured: the floor
    pacer.observe(decodes=0, prompt_tokens=512, seconds=1.0)  # a prefill alone: no decode to pace
    assert pacer.prompt_budget() == 4
    pacer.observe(decodes=1, prompt_tokens=0, seconds=0.020)  # decodes alone: 20 ms
    assert pacer.decode_s == pytest.approx(0.020)
    pacer.observe(decodes=1, prompt_tokens=16, seconds=0.021)  # 16 tokens nearly free: grow, at most 2x
    assert pacer.prompt_budget() == 32
    pacer.observe(decodes=1, prompt_tokens=32, seconds=0.120)  # 100 ms over the decode: far past the target
    room = (2.5 * 0.85 - 1) * 0.020
    assert pacer.prompt_budget() == int(32 * room / 0.100)
    pacer.observe(decodes=1, prompt_tokens=8, seconds=10.0)  # never below the floor
    assert pacer.prompt_budget() == 4


@pytest.mark.parametrize("factor", [2.5, 0.0])
def test_a_short_request_is_not_queued_behind_a_long_prefill(factor):
    """The stream comes once the long prompt's prefill has begun. With pacing (the server's
    default) its prompt runs next step (shortest first) and its 24 tokens all come before the long
    prompt's first; without it (offline use) the long prompt's chunks take the whole budget."""
    from pagedllm import LLM

    llm = LLM(
        "default",
        kv_cache_memory_mb=96,
        enable_prefix_caching=False,
        max_num_batched_tokens=512,
        max_model_len=4096,
        decode_latency_factor=factor,
    )
    eng = llm.engine
    long_ids = llm.tokenizer.encode("the river and the mountain " * 600)[:3000]
    long_rid = eng.add_request(long_ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    eng.step()
    short_rid = eng.add_request(
        llm.tokenizer.encode("Hello there, how are you?"),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    )
    order = []
    while eng.has_unfinished():
        order += [out.request_id for out in eng.step() if out.finished]
    assert order == ([short_rid, long_rid] if factor else [long_rid, short_rid])
