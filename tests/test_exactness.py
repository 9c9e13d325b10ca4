"""Prefill logits and greedy tokens against transformers on the same weights (float32)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from models import FAMILIES, build_checkpoint, reference_family

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

PROMPT_LENS = [1, 7, 31, 64, 100, 173, 250, 300, 600]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=FAMILIES)
def family_ckpt(request, tmp_path_factory, hf_smollm2_tokenizer):
    path, ref, prompts, expected = reference_family(
        request.param, tmp_path_factory.mktemp(request.param), hf_smollm2_tokenizer, PROMPT_LENS, NEW_TOKENS, seed=1234
    )
    return request.param, path, ref, prompts, expected


def _greedy(llm: LLM, prompts):
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_prefill_logits_match(family_ckpt):
    family, path, ref, prompts, _ = family_ckpt
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16)
    for p in prompts[-3:]:
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0]
        got = llm.prompt_logits(p)
        err = (got - want).abs().max().item()
        assert err < 1e-4, f"{family}: prefill logits differ by {err}"


def test_greedy_tokens_batched(family_ckpt):
    family, path, _, prompts, expected = family_ckpt
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16)
    assert _greedy(llm, prompts) == expected
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


@pytest.mark.parametrize("variant", ["block8", "block16", "contiguous", "preempt"])
def test_same_tokens_across_cache_layouts(family_ckpt, variant):
    family, path, _, prompts, expected = family_ckpt
    kwargs = {
        "block8": dict(block_size=8, kv_cache_memory_mb=16),
        "block16": dict(block_size=16, kv_cache_memory_mb=16),
        "contiguous": dict(paged_attention=False, kv_cache_memory_mb=16),
        # Far fewer blocks than the batch needs at once, and small prefill chunks so
        # running sequences keep growing: it must preempt (Mistral's window frees
        # blocks as it goes, so it gets an even smaller cache).
        "preempt": dict(
            block_size=8, max_num_batched_tokens=64, kv_cache_context_len=160 if family == "mistral" else 700
        ),
    }[variant]
    llm = LLM(str(path), dtype="float32", **kwargs)
    assert _greedy(llm, prompts) == expected
    eng = llm.engine
    if variant == "preempt":
        assert eng.scheduler.num_preemptions > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks
    assert not eng.requests and not eng.scheduler.has_unfinished()
    if variant == "contiguous":
        assert eng.backend.num_seqs_held == 0


def test_phi3_longrope_long_factors(tmp_path, hf_smollm2_tokenizer):
    """Prompts past LongRoPE's original length: transformers rotates by the long factors (and
    the attention factor) for the whole sequence, and so do we once max_model_len passes it."""
    import transformers as tf

    tok = hf_smollm2_tokenizer
    path = build_checkpoint("phi3", tmp_path / "phi3", tok, len(tok), original_max_position_embeddings=64)
    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, len(tok), (n,), generator=g).tolist() for n in (65, 173, 300)]
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16)
    for p in prompts:
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0]
        err = (llm.prompt_logits(p) - want).abs().max().item()
        assert err < 1e-4, f"long-factor prefill logits differ by {err}"
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = ref.generate(
                torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            expected.append(out[0, len(p) :].tolist())
    assert _greedy(llm, prompts) == expected
