"""Tensor parallelism for the families whose layers are not Llama's: Gemma 2 (sliding and global
layers, the extra norms, scaled embedding, attention and final-logit soft-capping), Gemma 3 (four
KV groups, per-head q/k norms), a Mixtral-shaped mixture of experts, Qwen2 with sliding layers
above a global one (three KV groups), and Phi-3 (q|k|v and gate|up fused in the checkpoint). Every KV
group's block tables reach the other ranks in the step message (distributed/messages.py).

tp=2 gives transformers' float32 greedy tokens and tp=1's, under preemption, with a prompt far
longer than the sliding window (48); pp=2 x tp=2 (4 ranks, 1 thread each) gives those of pp=1
and transformers with preemption, prefix caching and n=4 in the same run."""

from __future__ import annotations

import pytest

from models import reference_family
from test_pipeline_llm import run_pp2_tp2
from test_tensor_parallel import NEW_TOKENS, PROMPT_LENS, run_tp2

# slow: whole models in several processes; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

# The test Gemma 3 has 6 query heads over 3 KV heads, which 2 ranks cannot split (nor replicate):
# 2 KV heads here, so each rank holds 3 query heads and 1 KV head.
OVERRIDES = {
    "gemma3": dict(num_key_value_heads=2),
    # Layer 0 global, layers 1-2 sliding (transformers reads layer_types).
    "qwen2_windows": dict(
        use_sliding_window=True,
        sliding_window=48,
        max_window_layers=1,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    ),
}
# Block tables per sequence: one global group and the sliding groups, each of one layer (as many
# as the fewer kind has: kv/groups.py); Mixtral slides in every layer, one group.
GROUPS = {"gemma2": 3, "gemma3": 4, "mixtral": 1, "qwen2_windows": 3, "phi3": 1}
# Blocks of 16 and a KV budget far below the batch's need (five prompts of up to 324 tokens),
# so it preempts; more groups take more blocks a token, hence the smaller budgets there.
KW = dict(dtype="float32", block_size=16, max_num_batched_tokens=64)
CTX = {"gemma2": 240, "gemma3": 200, "mixtral": 240, "qwen2_windows": 300, "phi3": 400}


def _reference(name, tmp_path_factory, tok):
    family = "qwen2" if name == "qwen2_windows" else name
    return reference_family(
        family, tmp_path_factory.mktemp(name), tok, PROMPT_LENS, NEW_TOKENS, seed=99, **OVERRIDES.get(name, {})
    )


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "mixtral", "qwen2_windows", "phi3"])
def family(request, tmp_path_factory, hf_smollm2_tokenizer):
    """(name, checkpoint, transformers model, prompts, transformers' greedy tokens)."""
    return request.param, *_reference(request.param, tmp_path_factory, hf_smollm2_tokenizer)


def test_tp2_matches_transformers_and_tp1(family):
    name, path, ref, prompts, want = family
    kw = dict(KW, kv_cache_context_len=CTX[name])

    def check(llm):
        assert llm.engine.block_manager.num_groups == GROUPS[name]
        attn = llm.engine.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (ref.config.num_attention_heads // 2, 1)

    run_tp2(name, path, ref, prompts, want, kw, check)


@pytest.mark.parametrize("name", ["gemma3", "mixtral"])
def test_pp2_tp2_matches_transformers_and_pp1(name, tmp_path_factory, hf_smollm2_tokenizer):
    """Four ranks, 1 thread each: two stages, each split over two tensor-parallel ranks; greedy
    tokens under preemption, a three-turn chat reusing its earlier turns from the prefix cache,
    and n=4 greedy forks, equal to pp=1's and transformers'."""
    path, _, prompts, want = _reference(name, tmp_path_factory, hf_smollm2_tokenizer)
    kw = dict(KW, kv_cache_context_len=CTX[name])
    t4, t1 = run_pp2_tp2(name, path, prompts, want, kw, GROUPS[name])
    whole_kv = t1.rank_kv_mb[0]
    if name == "gemma3":
        # Groups of one layer: a page is one layer's slot on every stage (docs/scale-out.md), and
        # each rank holds 1 of the 2 KV heads.
        assert t4.rank_kv_mb == pytest.approx([whole_kv / 2] * 4, rel=1e-6)
    else:  # 3 layers, 1 + 2 or 2 + 1, each rank half the KV heads
        assert sorted(t4.rank_kv_mb) == pytest.approx([whole_kv / 6] * 2 + [whole_kv / 3] * 2, rel=1e-6)
    assert all(w < t1.rank_weight_mb[0] / 2 for w in t4.rank_weight_mb)
