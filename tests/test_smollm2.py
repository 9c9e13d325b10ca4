"""The embedded default model (SmolLM2-135M-Instruct GGUF) against transformers reading the same file."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

PROMPT_LENS = [1, 5, 17, 40, 80, 150, 220, 300]


@pytest.fixture(scope="module")
def hf_model(hf_smollm2_model):
    return hf_smollm2_model


@pytest.fixture(scope="module")
def llm():
    return LLM("default", dtype="float32", kv_cache_memory_mb=64)


@pytest.fixture(scope="module")
def prompts(hf_smollm2_tokenizer):
    text = ("The history of the printing press begins in the fifteenth century, when movable type "
            "changed how books were made and read across Europe. ") * 12
    ids = hf_smollm2_tokenizer(text)["input_ids"]
    return [ids[:n] for n in PROMPT_LENS]


def test_prefill_logits_match_transformers(llm, hf_model, prompts):
    for p in (prompts[3], prompts[-1]):
        with torch.no_grad():
            want = hf_model(torch.tensor([p])).logits[0]
        got = llm.engine.prompt_logits(p)
        err = (got - want).abs().max().item()
        assert err < 1e-4, f"prompt of {len(p)} tokens: max abs logit error {err}"


def test_greedy_tokens_match_transformers_in_one_batch(llm, hf_model, prompts):
    want = []
    with torch.no_grad():
        for p in prompts:
            out = hf_model.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32,
                                    do_sample=False, pad_token_id=0)
            want.append(out[0, len(p):].tolist())
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    assert [o.token_ids for o in outs] == want


def test_chat_answers_in_english(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def test_bf16_logits_as_close_to_float32_as_transformers_bf16(hf_model, prompts):
    """The default path on bf16 CPUs, prefill and token-by-token decode (native GEMV and paged decode
    kernel), against transformers. Ours in bf16 must be about as far from float32 as transformers
    in bf16 is. Measured on this model (AVX-512 BF16 CPU): mean |error| vs float32 0.106 (ours)
    against 0.118 (transformers) for a 150-token prefill, 0.105 against 0.105 decoding 48 tokens;
    max 1.00 against 0.86 and 0.69 against 0.66; argmax agreement with float32 0.993 and 0.979.
    The bounds leave 25% on the mean, 2x on the max."""
    import copy

    hf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
    ours = LLM("default", dtype="bfloat16", kv_cache_memory_mb=64)
    for p, chunk in ((prompts[5], None), (prompts[3][:40], 1)):
        with torch.no_grad():
            ref = hf_model(torch.tensor([p])).logits[0]
            ref16 = hf16(torch.tensor([p])).logits[0].float()
        got = ours.engine.prompt_logits(p, chunk_size=chunk)
        theirs, mine = (ref16 - ref).abs(), (got - ref).abs()
        assert mine.mean() <= 1.25 * theirs.mean(), (len(p), chunk, mine.mean(), theirs.mean())
        assert mine.max() <= 2 * theirs.max(), (len(p), chunk, mine.max(), theirs.max())
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95
