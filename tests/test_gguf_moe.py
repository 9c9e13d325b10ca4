"""GGUF files of the mixture-of-experts architectures (llama.cpp's `llama` with expert_count,
`qwen2moe`, `qwen3moe`, `olmoe`), written here with the gguf package from a random-weight
transformers model, against transformers holding the values the file holds.

transformers reads none of these files reliably here (olmoe and a llama file with experts not
at all), so the reference is the same transformers model with every weight replaced by what
the file stores (quantized and dequantized by gguf's own reference code)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from models import MOE_FAMILIES, build_model
from test_gguf import _llama_permute, _spm_vocab

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

Q = gguf.GGMLQuantizationType
ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
# Expert widths that are whole Q8_0 blocks (and Q4_K superblocks where hidden is 256).
WIDTHS = {
    "mixtral": {},
    "qwen2_moe": {"expert_size": 64},
    "qwen3_moe": {"expert_size": 64},
    "olmoe": {"expert_size": 64},
}
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _stored(a: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """(what the file holds, the values it stands for)."""
    if qtype == Q.F32 or a.ndim < 2 or a.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return a, a
    q = gguf.quants.quantize(a, qtype)
    return q, gguf.quants.dequantize(q, qtype).reshape(a.shape)


def write_moe_gguf(path, family: str, model, qtype, skip=(), reshape=None) -> None:
    """As llama.cpp's converter writes the family (q/k rows permuted for `llama`; the experts as
    3-D ffn_*_exps; the router and norms in F32); other matrices in `qtype`. The model's
    weights become the values the file stands for. `skip`: tensor names left out; `reshape`:
    name -> a function applied to the array written (bad-input tests)."""
    arch, cfg = ARCH[family], model.config
    tokens, types, scores = _spm_vocab()
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(len(tokens))
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if getattr(cfg, "sliding_window", None) and arch == "llama":
        w.add_sliding_window(cfg.sliding_window)
    if arch == "olmoe" and cfg.clip_qkv:
        w.add_float32("olmoe.attention.clamp_kqv", cfg.clip_qkv)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    state = model.state_dict()
    for name, t in state.items():
        a = t.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            out = [("token_embd.weight", a)]
        elif name == "model.norm.weight":
            out = [("output_norm.weight", a)]
        elif name == "lm_head.weight":
            out = [("output.weight", a)]
        else:
            _, _, layer, rest = name.split(".", 3)
            if rest.endswith("experts.gate_up_proj"):
                half = a.shape[1] // 2
                out = [
                    (f"blk.{layer}.ffn_gate_exps.weight", a[:, :half]),
                    (f"blk.{layer}.ffn_up_exps.weight", a[:, half:]),
                ]
            elif rest.endswith("experts.down_proj"):
                out = [(f"blk.{layer}.ffn_down_exps.weight", a)]
            else:
                part, kind = rest.rsplit(".", 1)
                out = [(f"blk.{layer}.{_LAYER[part]}.{kind}", a)]
        held = []
        for gname, arr in out:
            keep_float = "norm" in gname or "gate_inp" in gname or arr.ndim < 2
            file_arr, values = _stored(np.ascontiguousarray(arr), Q.F32 if keep_float else qtype)
            held.append(values)
            if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
                heads = cfg.num_attention_heads if ".attn_q." in gname else cfg.num_key_value_heads
                file_arr = _llama_permute(file_arr, heads)
            if gname.endswith("ffn_gate_inp_shexp.weight"):
                file_arr = file_arr.reshape(-1)  # llama.cpp's [hidden] vector
            if reshape and gname in reshape:
                file_arr = reshape[gname](file_arr)
            if gname in skip:
                continue
            if file_arr.dtype == np.uint8:
                w.add_tensor(gname, file_arr, raw_dtype=qtype)
            else:
                w.add_tensor(gname, file_arr)
        with torch.no_grad():
            t.copy_(torch.from_numpy(np.concatenate(held, axis=1) if len(held) == 2 else held[0]).view(t.shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _model(family: str, vocab: int, **extra):
    return build_model(family, vocab, 1, 2, seed=5, **{**WIDTHS[family], **extra}).eval()


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_gguf_moe_matches_transformers(tmp_path, family, qtype):
    vocab = len(_spm_vocab()[0])
    ref = _model(family, vocab)
    write_moe_gguf(tmp_path / "m.gguf", family, ref, qtype)
    llm = LLM(str(tmp_path / "m.gguf"), dtype="float32", kv_cache_memory_mb=16, dequantize_weights=True)
    assert llm.engine.model_config.architecture == type(ref).__name__
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 40, 97)]
    with torch.no_grad():
        want = ref(torch.tensor([prompts[-1]])).logits[0]
        expected = [
            ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    err = (llm.prompt_logits(prompts[-1]) - want).abs().max().item()
    assert err < 1e-4, f"{family} {qtype.name}: prefill logits differ by {err}"
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == expected


def test_expert_count_without_expert_tensors(tmp_path):
    vocab = len(_spm_vocab()[0])
    ref = _model("olmoe", vocab)
    skip = {f"blk.{i}.ffn_{p}_exps.weight" for i in range(3) for p in ("gate", "up", "down")}
    write_moe_gguf(tmp_path / "m.gguf", "olmoe", ref, Q.F32, skip=skip)
    with pytest.raises(
        ValueError,
        match=r"olmoe.expert_count = 8 but the file has no expert tensors "
        r"\(blk.N.ffn_gate_exps",
    ):
        LLM(str(tmp_path / "m.gguf"), dtype="float32", kv_cache_memory_mb=16)


def test_expert_tensor_of_the_wrong_shape(tmp_path):
    vocab = len(_spm_vocab()[0])
    ref = _model("qwen3_moe", vocab)
    write_moe_gguf(
        tmp_path / "m.gguf",
        "qwen3_moe",
        ref,
        Q.F32,
        reshape={"blk.2.ffn_up_exps.weight": lambda a: np.ascontiguousarray(a[:7])},
    )
    with pytest.raises(
        ValueError,
        match=r"tensor blk.2.ffn_up_exps.weight has shape \(64, 64, 7\), "
        r"expected \(64, 64, 8\)",
    ):
        LLM(str(tmp_path / "m.gguf"), dtype="float32", kv_cache_memory_mb=16)


def test_expert_used_count_above_expert_count(tmp_path):
    vocab = len(_spm_vocab()[0])
    ref = _model("qwen2_moe", vocab)
    ref.config.num_experts_per_tok = 9
    write_moe_gguf(tmp_path / "m.gguf", "qwen2_moe", ref, Q.F32)
    with pytest.raises(
        ValueError,
        match=r"qwen2moe.expert_used_count = 9 must be between 1 and "
        r"qwen2moe.expert_count = 8",
    ):
        LLM(str(tmp_path / "m.gguf"), dtype="float32", kv_cache_memory_mb=16)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=["Q8_0", "Q4_0"])
def test_quantized_experts_stay_quantized_and_agree(tmp_path, qtype):
    """The experts run on the file's blocks (packed, no float copy) and predict as the same
    file dequantized to float32 does, teacher-forced through the decode and prefill paths."""
    from pagedllm.quant.kernels import kernel_path

    if kernel_path()[0] is None:
        pytest.skip(f"no quantized kernels here: {kernel_path()[1]}")
    vocab = len(_spm_vocab()[0])
    write_moe_gguf(tmp_path / "m.gguf", "olmoe", _model("olmoe", vocab), qtype)
    q = LLM(str(tmp_path / "m.gguf"), dtype="float32", kv_cache_memory_mb=16)
    moe = q.engine.model.layers[0].mlp
    for e in moe.experts:
        for proj in (e.gate_up_proj, e.down_proj):
            assert proj.weight is None and [p.fmt for p in proj.qparts] == [qtype.name] * len(proj.qparts)
    assert all(p.packed for p in moe.experts[0].gate_up_proj.qparts)
    d = LLM(str(tmp_path / "m.gguf"), dtype="float32", kv_cache_memory_mb=16, dequantize_weights=True)
    g = torch.Generator().manual_seed(11)
    windows = [torch.randint(3, vocab, (96,), generator=g).tolist() for _ in range(6)]
    ref: list[torch.Tensor] = []
    d.score_prompts(windows, chunk_size=97, top1=ref)
    for chunk in (1, 97):  # every token a decode row (integer kernels), whole windows (GEMMs)
        got: list[torch.Tensor] = []
        q.score_prompts(windows, chunk_size=chunk, top1=got)
        agree = (torch.cat(got) == torch.cat(ref)).double().mean().item()
        assert agree >= 0.98, f"{qtype.name}, chunk {chunk}: top-1 agreement {agree:.3f}"


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_few_rows_run_their_experts_in_one_native_call(tmp_path, monkeypatch, rows, tune):
    """A step of up to INT_ROWS rows: every routed expert in one quant_moe_experts call, no
    Python matmul per expert; the values of the grouped path (one call chain per active
    expert), which the agreement test above holds to the dequantized model."""
    from pagedllm.models.moe import route
    from pagedllm.quant import kernels as qk

    if not qk.moe_experts_available():
        pytest.skip("the native kernels (quant_moe_experts) are not built here")
    vocab = len(_spm_vocab()[0])
    write_moe_gguf(tmp_path / "m.gguf", "olmoe", _model("olmoe", vocab), Q.Q8_0)
    moe = LLM(str(tmp_path / "m.gguf"), dtype="float32", kv_cache_memory_mb=16).engine.model.layers[0].mlp
    h = torch.randn(rows, moe.gate.in_features, generator=torch.Generator().manual_seed(3))
    weights, ids = route(moe.router_logits(h), moe.top_k, moe.renormalize)
    plan = moe._native_experts()
    native, per_expert = [], []
    real_native, expert_forward = qk.moe_experts, type(moe.experts[0]).forward
    monkeypatch.setattr(qk, "moe_experts", lambda *a: native.append(1) or real_native(*a))
    monkeypatch.setattr(
        type(moe.experts[0]), "forward", lambda self, *a, **kw: per_expert.append(1) or expert_forward(self, *a, **kw)
    )
    fast = moe.run_experts(h, weights, ids)
    assert (native, per_expert) == ([1], [])
    assert "in one native call" in moe.path()
    assert sum(moe.last_counts) == rows * moe.top_k
    # "auto" rounds the experts' inputs by the step's width, as a dense layer's gate|up and down:
    # two levels up to X2_ROWS rows, one beyond (where the grouped path goes by each expert's rows).
    for mode in ("int8x2", "int8"):
        tune(quant_act=mode)
        moe._native = plan
        one_call = moe.run_experts(h, weights, ids)
        if mode == ("int8x2" if rows <= qk.X2_ROWS else "int8"):
            assert torch.equal(one_call, fast), mode
        moe._native = None  # the grouped path, which rounds each expert's rows alike in these modes
        grouped = moe.run_experts(h, weights, ids)
        assert torch.allclose(one_call, grouped, rtol=1e-4, atol=1e-5), (mode, (one_call - grouped).abs().max())
    tune(quant_act="auto")
    assert len(per_expert) == 2 * len(ids.unique())
    # The ids matter: each row's experts moved to the next ids gives another result.
    moe._native = False
    wrong = moe.run_experts(h, weights, (ids + 1) % moe.num_experts)
    assert not torch.allclose(wrong, fast, rtol=1e-2, atol=1e-3)
    with pytest.raises(RuntimeError, match=f"expert id {moe.num_experts} out of range"):
        real_native(h, torch.full_like(ids, moe.num_experts), weights, moe._native_experts())
    # Only the step's experts are checked and read: a down projection cut short is refused
    # where it is routed to, and never touched where it is not.
    import dataclasses

    plan = moe._native_experts()
    idle = [e for e in range(moe.num_experts) if e not in ids.unique().tolist()][:1]  # (none at 32 rows)
    busy = int(ids[0, 0])
    for e in idle + [busy]:
        down = list(plan.down)
        down[e] = down[e][:-1]
        cut = dataclasses.replace(plan, down=down)
        if e != busy:
            assert torch.equal(real_native(h, ids, weights, cut), real_native(h, ids, weights, plan))
        else:
            with pytest.raises(RuntimeError, match=f"expert {busy}'s down"):
                real_native(h, ids, weights, cut)
    assert real_native(h[:0], ids[:0], weights[:0], plan).shape == (0, h.shape[1])  # no rows, no experts


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_few_rows_run_the_whole_block_in_one_native_call(tmp_path, monkeypatch, family):
    """From the layer's residual stream: norm, router, softmax, top k, the experts and the
    residual add in one quant_moe_block call, with the ids and values of the block run op by
    op (Qwen2-MoE's shared expert keeps it op by op)."""
    from pagedllm.quant import kernels as qk

    if not qk.moe_experts_available():
        pytest.skip("the native kernels (quant_moe_block) are not built here")
    vocab = len(_spm_vocab()[0])
    write_moe_gguf(tmp_path / "m.gguf", family, _model(family, vocab), Q.Q8_0)
    layer = LLM(str(tmp_path / "m.gguf"), dtype="float32", kv_cache_memory_mb=16).engine.model.layers[0]
    moe, norm = layer.mlp, layer.post_attention_layernorm
    calls = []
    real = qk.moe_block
    monkeypatch.setattr(qk, "moe_block", lambda *a: calls.append(1) or real(*a))
    for rows in (1, 7, 32):
        x = torch.randn(rows, moe.gate.in_features, generator=torch.Generator().manual_seed(rows))
        fused = moe(x, norm=norm, residual=x)
        fused_ids = moe._last_ids
        plain = moe(x, norm=norm, residual=x.clone())  # another residual tensor: op by op
        assert torch.equal(moe._last_ids, fused_ids)
        assert torch.allclose(fused, plain, rtol=1e-4, atol=1e-5), (rows, (fused - plain).abs().max())
    assert len(calls) == (0 if family == "qwen2_moe" else 3)
    assert ("router, softmax, top k too" in moe.path()) == (family != "qwen2_moe")
