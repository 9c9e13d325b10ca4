"""In-situ quantization: our quantizers against gguf-py's reference quantizers and dequantization,
and a safetensors model quantized at load against transformers running the same rounded weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm import LLM
from pagedllm.quant.formats import QuantFormatError
from pagedllm.quant.isq import ISQ_TYPES, quantize, requantize
from pagedllm.models.decode_stack import stack_plan
from pagedllm.quant.kernels import available_isas

Q = gguf.GGMLQuantizationType
# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not available_isas(), reason="native CPU kernels not built here")]


def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0] = 0.0  # an all-zero row: zero scales
    w[1, :7] = torch.tensor([3.0, -3.0, 1e-3, -1e-3, 0.5, 0.0, 2.0])  # outliers in one block
    w[2] = w[2].abs() + 0.01  # all positive: the K-quants' offset clamps at zero
    return w


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_legacy_isq_is_byte_exact_with_ggufs_quantizer(fmt):
    w = _weights(33, 512, 1)
    ours = quantize(w, fmt).data.numpy()
    ref = gguf.quants.quantize(w.numpy(), Q[fmt])
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("src", ["Q5_0", "Q8_0", "Q6_K"])
def test_requantize_is_ggufs_quantizer_on_ggufs_dequantized_values(src):
    """A weight rounded again (a speculative draft's, engine/draft_weights.py): gguf-py's Q4_0
    quantizer on gguf-py's dequantization of the source blocks, byte for byte, whole or its
    first rows, and from the packed layout the same values."""
    from pagedllm.quant.formats import QuantTensor

    w = _weights(64, 512, 3)
    src_blocks = quantize(w, src)
    ref = gguf.quants.quantize(gguf.quants.dequantize(src_blocks.data.numpy(), Q[src]).reshape(64, 512), Q.Q4_0)
    got = requantize(src_blocks, "Q4_0")
    assert got.fmt == "Q4_0" and not got.packed and got.shape == (64, 512)
    # (Row 0 is zero: gguf-py dequantizes it to -0.0, which its quantizer scales by +0.0, and
    # our kernel to +0.0, scaled by -0.0: the same zero weights, a scale's sign bit apart.)
    np.testing.assert_array_equal(got.data.numpy()[1:], ref[1:])
    np.testing.assert_array_equal(gguf.quants.dequantize(got.data.numpy(), Q.Q4_0), gguf.quants.dequantize(ref, Q.Q4_0))
    np.testing.assert_array_equal(requantize(src_blocks, "Q4_0", rows=32).data.numpy()[1:], ref[1:32])
    packed = QuantTensor(src, src_blocks.data.clone(), (64, 512)).pack()
    again = requantize(packed, "Q4_0", rows=48)
    assert again.packed and again.shape == (48, 512)
    back = gguf.quants.dequantize(ref[:48], Q.Q4_0).reshape(48, 512)
    from pagedllm.quant import kernels as qk

    np.testing.assert_array_equal(qk.embedding(again, torch.arange(48), torch.float32).numpy(), back)


# Each K-quant's step at a 256-value block: what one code step can be worth there (a packing bug
# errs by the whole range), and the relative RMS error measured on these weights, with headroom.
K_STEPS = {
    "Q4_K": (lambda b: (b.max(-1, keepdims=True) - np.minimum(b.min(-1, keepdims=True), 0)) / 15, 0.15),  # 0.123
    "Q5_K": (lambda b: (b.max(-1, keepdims=True) - np.minimum(b.min(-1, keepdims=True), 0)) / 31, 0.07),  # 0.051
    "Q6_K": (lambda b: np.abs(b).max(-1, keepdims=True) / 32, 0.03),  # 0.022
}


@pytest.mark.parametrize("fmt", list(K_STEPS))
def test_k_quant_isq_round_trip(fmt):
    """gguf-py has no K-quant quantizer; its dequantizer reads our blocks back."""
    w = _weights(33, 512, 2)
    qt = quantize(w, fmt)
    back = gguf.quants.dequantize(qt.data.numpy(), Q[fmt]).reshape(w.shape)
    blocks = w.view(33, -1, 256).numpy()
    err = np.abs(back.reshape(blocks.shape) - blocks)
    step_of, rms_bound = K_STEPS[fmt]
    step = step_of(blocks)
    assert (err <= step + 1e-6).all(), (err / np.maximum(step, 1e-9)).max()
    rel_rms = np.sqrt((err**2).mean()) / w.std().item()
    assert rel_rms < rms_bound, rel_rms  # the outlier row dominating
    assert not back[0].any()  # the all-zero row stays zero


def test_isq_falls_back_per_tensor_and_refuses_what_nothing_fits(caplog):
    w = _weights(4, 96, 3)
    with caplog.at_level("INFO", logger="pagedllm.quant.isq"):
        qt = quantize(w, "Q4_K", "model.layers.0.mlp.down_proj.weight")
    assert qt.fmt == "Q5_0"  # llama.cpp's fallback for Q4_K rows that 256-value blocks do not tile
    np.testing.assert_array_equal(qt.data.numpy(), gguf.quants.quantize(w.numpy(), Q.Q5_0))
    assert "model.layers.0.mlp.down_proj.weight: 96 columns are not whole Q4_K blocks" in caplog.text
    with pytest.raises(QuantFormatError, match="blocks of 32.*no ISQ type fits it"):
        quantize(torch.zeros(4, 48), "Q4_0", "model.layers.0.mlp.down_proj.weight")
    with pytest.raises(QuantFormatError, match="NaN"):
        quantize(torch.full((2, 32), float("nan")), "Q8_0")
    with pytest.raises(ValueError, match="unsupported ISQ type 'Q3_X'"):
        LLM("default", isq="Q3_X")
    with pytest.raises(ValueError, match="--isq 3 means Q3_K"):
        LLM("default", isq="3")
    with pytest.raises(ValueError, match="unsupported ISQ bit width '7'"):
        LLM("default", isq="7")
    with pytest.raises(ValueError, match="GGUF file whose weights are already quantized"):
        LLM("default", isq="Q8_0")


@pytest.fixture(scope="module")
def isq_ckpt(tmp_path_factory, hf_smollm2_tokenizer):
    """A Llama whose rows are multiples of 256, so every ISQ type fits."""
    import transformers as tf

    tok = hf_smollm2_tokenizer
    cfg = tf.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    out = tmp_path_factory.mktemp("isq")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, model


@pytest.mark.parametrize("fmt", ISQ_TYPES)
def test_isq_model_matches_transformers_on_the_rounded_weights(isq_ckpt, fmt):
    path, ref = isq_ckpt
    llm = LLM(str(path), dtype="float32", isq=fmt, kv_cache_memory_mb=8)
    info = llm.engine.weights
    assert info.kernel is not None and f"ISQ {fmt}" in info.reason
    assert info.formats.get(fmt) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    # transformers with every linear weight replaced by what the quantized blocks stand for.
    import copy

    rounded = copy.deepcopy(ref)
    with torch.no_grad():
        for name, mod in rounded.named_modules():
            if isinstance(mod, torch.nn.Linear):
                qt = quantize(mod.weight, fmt, name)
                back = gguf.quants.dequantize(qt.data.numpy(), Q[fmt]).reshape(mod.weight.shape)
                mod.weight.copy_(torch.from_numpy(back))
    prompt = torch.randint(0, 49152, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        want = rounded(torch.tensor([prompt])).logits[0]
    got = llm.prompt_logits(prompt)  # 80 rows: the dequantize + GEMM route, exact
    assert (got - want).abs().max().item() < 1e-3
    short = prompt[:20]  # 20 rows: the integer kernels, within int8-activation noise
    got_short = llm.prompt_logits(short)
    cos = torch.nn.functional.cosine_similarity(got_short, want[:20], dim=-1)
    assert cos.min().item() > 0.995, cos.min().item()


def test_batch1_decode_rounds_activations_in_two_levels(isq_ckpt, monkeypatch, tune):
    """Token by token (batch 1, the integer kernels on every projection), the default rounds
    each activation block twice (int8x2): its logits sit far closer to the float model on the
    same quantized weights than one int8 level, the rounding llama.cpp uses, leaves them."""
    tune(quant_act="auto")
    path, _ = isq_ckpt
    llm = LLM(str(path), dtype="float32", isq="Q4_K", kv_cache_memory_mb=8)
    prompt = torch.randint(0, 49152, (48,), generator=torch.Generator().manual_seed(9)).tolist()
    exact = llm.prompt_logits(prompt)  # 48 rows at once: dequantize + GEMM, no rounding
    assert "activations int8x2 up to 8 rows, int8 above except qkv_proj" in llm.engine.kv_cache_trace().weight_kernel
    errors = {"default": ((llm.prompt_logits(prompt, chunk_size=1) - exact).abs().max() / exact.abs().max()).item()}
    for mode in ("int8x2", "int8"):
        tune(quant_act=mode)
        got = llm.prompt_logits(prompt, chunk_size=1)
        errors[mode] = ((got - exact).abs().max() / exact.abs().max()).item()
    assert errors["default"] == errors["int8x2"]
    assert errors["int8x2"] < errors["int8"] / 20, errors
    with pytest.raises(ValueError, match="quant_act='int4' is not one of"):
        tune(quant_act="int4")


def _stack_against_layers(path, monkeypatch, **kw):
    """Greedy tokens and logprobs of a batch decoded with the all-layer native call, then with it
    off (layer by layer): (stacked outputs, per-layer outputs, the decode steps the stack took,
    the sampling params, the prompts, the LLM)."""
    from pagedllm import SamplingParams
    from pagedllm.models import llama

    prompts = [torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 40)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    calls = []
    real = llama.LlamaForCausalLM._decode_stack

    def counted(self, h, rope, meta):
        out = real(self, h, rope, meta)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(llama.LlamaForCausalLM, "_decode_stack", counted)
    llm = LLM(str(path), kv_cache_memory_mb=8, enable_prefix_caching=False, **kw)
    stacked = llm.generate(prompts, sp)
    monkeypatch.setattr(llama.LlamaForCausalLM, "_decode_stack", lambda self, h, rope, meta: None)
    plain = llm.generate(prompts, sp)
    monkeypatch.setattr(llama.LlamaForCausalLM, "_decode_stack", real)
    for a, b in zip(stacked, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp for lp in a.outputs[0].logprobs] == [lp for lp in b.outputs[0].logprobs]
    return stacked, plain, sum(calls), sp, prompts, llm


@pytest.mark.parametrize("fmt,kv", [("Q8_0", "auto"), ("Q4_K", "auto"), ("Q4_K", "int8"), ("Q4_K", "f8e4m3")])
def test_decode_stack_gives_the_per_layer_bits(isq_ckpt, fmt, kv, monkeypatch):
    """Decode steps of a quantized model run every layer in one native call; it must give the
    same bits as the per-layer path it replaces (greedy tokens and their logprobs, batched),
    with a plain cache and with an int8 or f8e4m3 one (written and read with its scales)."""
    path, _ = isq_ckpt
    *_, stacked_steps, _, _, _ = _stack_against_layers(path, monkeypatch, dtype="float32", isq=fmt, kv_cache_dtype=kv)
    assert stacked_steps > 0, "the decode stack never ran"


def test_decode_stack_finds_the_layer_pools_once(isq_ckpt, monkeypatch):
    """The all-layer decode looks up the layers' KV pools once, not every step (a Python loop
    over the layers); when other attention layers are set (as the runner and the f8e4m3
    calibration set them), it looks again and reads theirs."""
    from pagedllm import SamplingParams
    from pagedllm.attention.paged import PagedAttentionLayer
    from pagedllm.quant import kernels as qk

    if not qk.decode_layers_available():
        pytest.skip("the native library is not built here")
    path, _ = isq_ckpt
    llm = LLM(str(path), kv_cache_memory_mb=8, enable_prefix_caching=False, dtype="float32", isq="Q8_0")
    model = llm.engine.model
    looked: list = []
    real = PagedAttentionLayer.stack_kv
    monkeypatch.setattr(PagedAttentionLayer, "stack_kv", lambda self, dtype: looked.append(self) or real(self, dtype))
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = list(range(300, 320))
    first = llm.generate([prompt], sp)[0].outputs[0].token_ids
    attns = [a.attn for a in model.attention_modules()]
    assert looked == attns, "11 decode steps should look the pools up once"
    for a in model.attention_modules():
        old = a.attn
        a.attn = PagedAttentionLayer(old.kv, old.window, old.scale, old.native, old.softcap, old.group)
    looked.clear()
    again = llm.generate([prompt], sp)[0].outputs[0].token_ids
    assert looked == [a.attn for a in model.attention_modules()] and looked[0] is not attns[0]
    assert again == first


@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8")])
def test_decode_stack_applies_qwen3_qk_norms(tmp_path, hf_smollm2_tokenizer, dtype, kv, monkeypatch):
    """Qwen3 normalizes each q and k head before rope: the all-layer decode applies those norms
    too, and gives the per-layer path's bits (greedy tokens and logprobs, batched); without the
    norms in the stack the tokens differ (the random norm weights are far from one)."""
    from models import build_checkpoint

    from pagedllm.quant import kernels as qk

    if not qk.decode_layers_take_qk_norms():
        pytest.skip("the native library is not built here")
    path = build_checkpoint(
        "qwen3",
        tmp_path / "q3",
        hf_smollm2_tokenizer,
        len(hf_smollm2_tokenizer),
        intermediate_size=512,
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
    )
    _, plain, stacked_steps, sp, prompts, llm = _stack_against_layers(
        path, monkeypatch, dtype=dtype, isq="Q4_K", kv_cache_dtype=kv
    )
    assert stacked_steps >= 10, "the decode stack did not take Qwen3's layers"
    # The norms matter: the stack without them (as if the layers had none) goes elsewhere.
    plan = stack_plan(llm.engine.model)
    norms, plan["qk_norms"] = plan["qk_norms"], []
    try:
        unnormed = llm.generate(prompts, sp)
    finally:
        plan["qk_norms"] = norms
    assert [o.outputs[0].token_ids for o in unnormed] != [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
def test_decode_stack_runs_sparse_moe_layers(tmp_path, hf_smollm2_tokenizer, family, monkeypatch):
    """The all-layer decode runs a sparse block whole (norm, router, top k, experts, residual:
    quant_moe_block) in its layer, with Qwen3-MoE's per-head q/k norms, OLMoE's whole-projection
    ones and its clamp, and Qwen3-MoE's dense layers beside: the per-layer path's bits (greedy
    tokens and logprobs, batched), the trace's expert counts from the stack's step. Routing each
    stacked layer to the wrong experts must change the tokens."""
    from models import build_checkpoint

    from pagedllm.quant import kernels as qk

    if not qk.decode_layers_take_moe():
        pytest.skip("the native library is not built here")
    path = build_checkpoint(
        family,
        tmp_path / family,
        hf_smollm2_tokenizer,
        len(hf_smollm2_tokenizer),
        hidden_size=128,
        head_dim=32,
        expert_size=64,
    )
    _, plain, stacked_steps, sp, prompts, llm = _stack_against_layers(path, monkeypatch, dtype="float32", isq="Q8_0")
    model = llm.engine.model
    plan = stack_plan(model)
    assert stacked_steps >= 10 and plan["moe_layers"], "the decode stack did not take the sparse layers"
    assert (family == "qwen3_moe") == (len(plan["moe_layers"]) < len(model.layers))
    assert plan["qkv_clip"] == (4.0 if family == "olmoe" else 0.0)
    # A last step in the stack: the trace's counts are its rows times top k.
    llm.generate(prompts[:1], sp)
    for _, mlp in plan["moe_layers"]:
        assert mlp._stack_ids is not None and sum(mlp.last_counts) == mlp.top_k
    # The routers matter: a stack whose routers prefer other experts goes elsewhere.
    stack = plan["moe"]
    plan["moe"] = qk.moe_stack(
        [
            None
            if i not in dict(plan["moe_layers"])
            else (-m._router32, m._native, m.top_k, m.renormalize, m.weights_in_compute_dtype)
            for i, m in ((i, dict(plan["moe_layers"]).get(i)) for i in range(len(model.layers)))
        ]
    )
    try:
        rerouted = llm.generate(prompts, sp)
    finally:
        plan["moe"] = stack
    assert [o.outputs[0].token_ids for o in rerouted] != [o.outputs[0].token_ids for o in plain]


def test_decode_stack_rounds_each_projection_as_the_layers_do(isq_ckpt, monkeypatch, tune):
    """Steps wider than X2_ROWS round only the X2_WIDE projections in two levels; the all-layer
    native call carries that per projection (bits of its isa argument) and must give the bits
    of the per-layer path for every choice, and the choice must change them."""
    from pagedllm import SamplingParams
    from pagedllm.models import llama
    from pagedllm.quant import kernels as qk

    tune(quant_act="auto")
    path, _ = isq_ckpt
    prompts = [
        torch.randint(0, 49152, (4 + n,), generator=torch.Generator().manual_seed(n)).tolist() for n in range(12)
    ]  # 12 rows a step: past X2_ROWS
    assert len(prompts) > qk.X2_ROWS
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    llm = LLM(str(path), dtype="float32", isq="Q4_K", kv_cache_memory_mb=8, enable_prefix_caching=False)
    real = llama.LlamaForCausalLM._decode_stack
    got = {}
    for wide in ("qkv_proj", "o_proj,down_proj", "gate_up_proj", ""):
        tune(quant_x2_wide=wide)
        calls = []

        def counted(self, h, rope, meta):
            out = real(self, h, rope, meta)
            calls.append(out is not None and h.shape[0] == len(prompts))
            return out

        monkeypatch.setattr(llama.LlamaForCausalLM, "_decode_stack", counted)
        stacked = llm.generate(prompts, sp, use_tqdm=False)
        assert any(calls), "no 12-row step ran in the decode stack"
        monkeypatch.setattr(llama.LlamaForCausalLM, "_decode_stack", lambda self, h, rope, meta: None)
        plain = llm.generate(prompts, sp, use_tqdm=False)
        got[wide] = [o.outputs[0].logprobs for o in stacked]
        assert got[wide] == [o.outputs[0].logprobs for o in plain], wide
    assert len({repr(v) for v in got.values()}) == len(got), "an X2_WIDE choice changed nothing"
    tune(quant_x2_wide="v_proj")
    with pytest.raises(ValueError, match="tuning quant_x2_wide names v_proj"):
        llm.generate(prompts[:1], sp, use_tqdm=False)


def test_wide_models_round_a_row_alike_at_every_step_width(isq_ckpt, monkeypatch, tune):
    """In a model at least X2_WIDTH wide, "auto" rounds narrow steps as wide ones (one level but
    X2_WIDE, the head rechecked): a sequence decoded alone gets the logprobs it gets among 11
    others. A narrower model rounds its batch-1 steps in two levels, so there they differ."""
    from pagedllm import SamplingParams
    from pagedllm.quant import kernels as qk

    tune(quant_act="auto")
    tune(quant_x2_wide=None)
    path, _ = isq_ckpt
    # (12 prompts of 2 tokens: their prefill, 24 rows, stays on the integer kernels too)
    prompts = [torch.randint(0, 49152, (2,), generator=torch.Generator().manual_seed(n)).tolist() for n in range(12)]
    assert qk.X2_ROWS < len(prompts) and 2 * len(prompts) <= qk.int_rows()
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    llm = LLM(str(path), dtype="float32", isq="Q4_K", kv_cache_memory_mb=8, enable_prefix_caching=False)
    hidden = llm.engine.model_config.hidden_size
    assert hidden < qk.X2_WIDTH  # (the model is narrow as it is)

    def alone_and_among_others():
        alone = llm.generate(prompts[:1], sp, use_tqdm=False)[0].outputs[0].logprobs
        among = llm.generate(prompts, sp, use_tqdm=False)[0].outputs[0].logprobs
        return alone, among

    def gap(a, b):  # the largest logprob difference; the same tokens chosen and ranked
        assert [[t for t, _ in x["top"]] for x in a] == [[t for t, _ in x["top"]] for x in b]
        return max(abs(p - q) for x, y in zip(a, b) for (_, p), (_, q) in zip(x["top"], y["top"]))

    alone, among = alone_and_among_others()
    # Two levels against one: far apart. (Sums in another order within a step of another
    # width move a logprob by float32 ulps, some 1e-6.)
    assert gap(alone, among) > 1e-3, "batch-1 steps of a narrow model should round in two levels"
    assert "activations int8x2 up to 8 rows" in llm.engine.kv_cache_trace().weight_kernel
    monkeypatch.setattr(qk, "X2_WIDTH", hidden)
    alone, among = alone_and_among_others()
    assert gap(alone, among) < 1e-5
    assert (
        f"activations int8 except qkv_proj at every width, the model {hidden} >= {hidden} wide"
        in llm.engine.kv_cache_trace().weight_kernel
    )
    tune(quant_act="int8x2")  # the choice by hand still holds
    alone_x2, _ = alone_and_among_others()
    assert gap(alone_x2, alone) > 1e-3


def test_mistral_rs_numeric_isq_resolves_as_on_a_cpu(isq_ckpt):
    from pagedllm.quant.isq import check_isq_type

    assert [check_isq_type(b) for b in ("4", "5", "6", "8")] == ["Q4_K", "Q5_K", "Q6_K", "Q8_0"]
    path, _ = isq_ckpt
    llm = LLM(str(path), dtype="float32", isq="4", kv_cache_memory_mb=8)
    assert llm.engine.weights.formats.get("Q4_K") == 2 * 7 + 1
