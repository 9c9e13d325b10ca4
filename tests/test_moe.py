"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against transformers on
the same random weights, float32: prefill logits, and greedy tokens across cache layouts,
preemption, prefix caching and n=4."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM, SamplingParams
from models import MOE_FAMILIES, build_checkpoint, reference_family

PROMPT_LENS = [1, 7, 31, 64, 100, 173, 250, 300, 600]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_ckpt(request, tmp_path_factory, hf_smollm2_tokenizer):
    path, ref, prompts, expected = reference_family(
        request.param, tmp_path_factory.mktemp(request.param), hf_smollm2_tokenizer, PROMPT_LENS, NEW_TOKENS, seed=4321
    )
    return request.param, path, ref, prompts, expected


def _greedy(llm: LLM, prompts, n: int = 1):
    sp = SamplingParams(n=n, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs] if n > 1 else [o.token_ids for o in outs]


def _clean(llm: LLM) -> None:
    eng = llm.engine
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks
    assert not eng.requests and not eng.scheduler.has_unfinished()


@pytest.mark.slow
def test_prefill_logits_match(moe_ckpt):
    family, path, ref, prompts, _ = moe_ckpt
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16)
    assert type(llm.engine.model).__name__ == type(ref).__name__
    for p in prompts[-3:]:
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0]
        err = (llm.prompt_logits(p) - want).abs().max().item()
        assert err < 1e-4, f"{family}: prefill logits differ by {err}"


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["block16", "block32", "contiguous", "preempt"])
def test_greedy_tokens_across_cache_layouts(moe_ckpt, variant):
    family, path, _, prompts, expected = moe_ckpt
    kwargs = {
        "block16": dict(block_size=16, kv_cache_memory_mb=16),
        "block32": dict(block_size=32, kv_cache_memory_mb=16),
        "contiguous": dict(paged_attention=False, kv_cache_memory_mb=16),
        # Far fewer blocks than the batch needs at once and small prefill chunks: it must
        # preempt (Mixtral's window frees blocks as it goes: a smaller cache still).
        "preempt": dict(
            block_size=16, max_num_batched_tokens=64, kv_cache_context_len=160 if family == "mixtral" else 700
        ),
    }[variant]
    llm = LLM(str(path), dtype="float32", **kwargs)
    assert _greedy(llm, prompts) == expected
    if variant == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    _clean(llm)


def test_prefix_cache_and_n4(moe_ckpt):
    """The prompts again, from the prefix cache, four greedy completions each."""
    family, path, _, prompts, expected = moe_ckpt
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=32, enable_prefix_caching=True)
    assert _greedy(llm, prompts) == expected
    assert _greedy(llm, prompts, n=4) == [[e] * 4 for e in expected]
    assert llm.engine.block_manager.stats.hits > 0
    _clean(llm)


def test_wrong_expert_is_caught(moe_ckpt, monkeypatch):
    """Routing each row to the next expert over must break the match (the tests can fail)."""
    from pagedllm.models import moe

    family, path, ref, prompts, expected = moe_ckpt
    real = moe.route

    def shifted(logits, k, renormalize):
        w, ids = real(logits, k, renormalize)
        return w, (ids + 1) % logits.shape[-1]

    monkeypatch.setattr(moe, "route", shifted)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16)
    with torch.no_grad():
        want = ref(torch.tensor([prompts[-1]])).logits[0]
    assert (llm.prompt_logits(prompts[-1]) - want).abs().max().item() > 1e-3
    assert _greedy(llm, prompts) != expected


def test_config_sparse_layers_and_routing_fields():
    from pagedllm.config import ModelConfig

    d = dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        norm_topk_prob=True,
    )
    c = ModelConfig.from_hf_dict(d)
    assert c.moe_layers == [False, True, False, False, False, True]
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (4, 2, 16, True)
    mix = ModelConfig.from_hf_dict(
        {
            **d,
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_experts": None,
            "num_local_experts": 8,
            "norm_topk_prob": None,
            "decoder_sparse_step": None,
            "mlp_only_layers": None,
            "moe_intermediate_size": None,
        }
    )
    assert (mix.num_experts, mix.norm_topk_prob, mix.moe_intermediate_size) == (8, True, 64)
    assert all(mix.moe_layers)


# ------------------------------------------------------------------------------------------
# bad input, refused at load naming the key or tensor


def test_more_experts_per_token_than_experts(tmp_path, hf_smollm2_tokenizer):
    tok = hf_smollm2_tokenizer
    path = build_checkpoint("olmoe", tmp_path / "m", tok, len(tok))
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_experts_per_tok"] = 9
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be between 1 and the model's 8 experts"):
        LLM(str(path), dtype="float32", kv_cache_memory_mb=16)


def test_expert_of_the_wrong_shape(tmp_path, hf_smollm2_tokenizer):
    from safetensors.torch import load_file, save_file

    tok = hf_smollm2_tokenizer
    path = build_checkpoint("qwen3_moe", tmp_path / "m", tok, len(tok))
    sd = load_file(path / "model.safetensors")
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    sd[name] = sd[name][:40].contiguous()
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"weight '{name}' has shape \(40, 64\), expected \(48, 64\)"):
        LLM(str(path), dtype="float32", kv_cache_memory_mb=16)


def test_trace_names_the_expert_path(moe_ckpt):
    family, path, _, prompts, _ = moe_ckpt
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16)
    llm.generate([prompts[1]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    t = llm.kv_cache_trace()
    model = llm.engine.model
    sparse = len(model.expert_paths())
    assert t.moe_experts.startswith(f"{sparse} sparse layers; 8 experts, top-2")
    assert "rows sorted by expert id" in t.moe_experts
    # The last step decoded one row: k experts in every sparse layer.
    rows = t.moe_last_step_rows_per_expert
    assert len(rows) == 8 and sum(rows) == 2 * sparse


@pytest.mark.parametrize("family", ["olmoe"])
def test_isq_quantizes_the_experts_and_keeps_the_router(tmp_path, hf_smollm2_tokenizer, family):
    """A safetensors MoE model quantized at load (ISQ Q8_0; experts 64 wide, whole Q8_0 blocks):
    experts quantized, router float, predictions as the float model's, teacher-forced."""
    from pagedllm.quant.kernels import kernel_path

    if kernel_path()[0] is None:
        pytest.skip(f"no quantized kernels here: {kernel_path()[1]}")
    tok = hf_smollm2_tokenizer
    path = build_checkpoint(family, tmp_path / family, tok, len(tok), expert_size=64)
    q = LLM(str(path), dtype="float32", kv_cache_memory_mb=16, isq="Q8_0")
    d = LLM(str(path), dtype="float32", kv_cache_memory_mb=16)
    for _, moe in q.engine.model.expert_paths():
        assert moe.gate.qparts is None and moe.gate.weight is not None
        assert all(e.gate_up_proj.qparts and e.down_proj.qparts for e in moe.experts)
    g = torch.Generator().manual_seed(9)
    windows = [torch.randint(0, len(tok), (64,), generator=g).tolist() for _ in range(3)]
    got, ref = [], []
    q.score_prompts(windows, chunk_size=1, top1=got)
    d.score_prompts(windows, chunk_size=1, top1=ref)
    agree = (torch.cat(got) == torch.cat(ref)).double().mean().item()
    assert agree >= 0.98, f"{family}: ISQ Q8_0 top-1 agreement {agree:.3f}"
