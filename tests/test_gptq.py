"""GPTQ checkpoints: packed by gptqmodel (the format's own library), repacked at load into the
GGUF block formats, held to gptqmodel's own dequantization bit for bit, to transformers running
the dequantized weights, and, quantized, to our own float32 run of the same checkpoint."""

from __future__ import annotations

import copy
import json

import gguf
import numpy as np
import pytest
import torch

from pagedllm import LLM
from pagedllm.quant import checkpoint as qc
from pagedllm.quant.formats import QuantFormatError
from pagedllm.quant.kernels import available_isas

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not available_isas(), reason="native CPU kernels not built here")]


def _gptqmodel():
    """gptqmodel's packing module and its v2 -> v1 converter (it needs torch >= 2.14 by its metadata,
    so it is not a declared dependency: `pip install --no-deps gptqmodel` and its small deps)."""
    qlinear = pytest.importorskip("gptqmodel.nn_modules.qlinear.torch")
    model_utils = pytest.importorskip("gptqmodel.utils.model")
    return qlinear.TorchLinear, model_utils.convert_gptq_v2_to_v1_format_module


def _rtn_params(w: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, sym: bool):
    """Round-to-nearest scales and zeros per (row, group), as GPTQ's quantizer picks them
    (sym: zero at the midpoint); the codes are then made by gptqmodel's pack."""
    maxq = 2**bits - 1
    out = w.shape[0]
    scales, zeros = torch.empty(out, groups), torch.empty(out, groups)
    for g in range(groups):
        wg = w[:, g_idx == g]
        if sym:
            s = wg.abs().amax(1) / (maxq // 2)
            z = torch.full((out,), (maxq + 1) / 2)
        else:
            lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
            s = (hi - lo) / (maxq - 1)  # one level of margin: pack rounds without clamping
            z = torch.round(-lo / s)
        scales[:, g] = s.half().float()
        zeros[:, g] = z
    return scales, zeros


def gptq_linear(w: torch.Tensor, bits: int, gs: int, sym: bool, desc_act: bool, seed: int = 0):
    """(checkpoint tensors, gptqmodel's dequantized weight [out, in] in float32) for float weight w."""
    TorchLinear, to_v1 = _gptqmodel()
    out_f, in_f = w.shape
    size = in_f if gs == -1 else gs
    g_idx = torch.arange(in_f) // size
    if desc_act:  # GPTQ's activation order: columns join groups in a data-dependent order
        g_idx = g_idx[torch.randperm(in_f, generator=torch.Generator().manual_seed(seed))]
    scales, zeros = _rtn_params(w, g_idx, in_f // size, bits, sym)
    lin = torch.nn.Linear(in_f, out_f, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    m = TorchLinear(
        bits=bits, group_size=gs, sym=sym, desc_act=desc_act, in_features=in_f, out_features=out_f, bias=False
    )
    m.pack(lin, scales, zeros, g_idx.int())
    m.post_init()
    # gptqmodel's dequantization (of the v2 zeros it keeps in memory): in its fp16, and with the
    # scales widened to float32, where scale * (q - z) is exact.
    ref16 = m.dequantize_weight().t().contiguous()
    half = m.scales
    m.scales = half.float()
    ref = m.dequantize_weight().t().contiguous()
    m.scales = half
    assert ref.dtype == torch.float32 and torch.equal(ref.half(), ref16)
    from types import SimpleNamespace

    to_v1(m, SimpleNamespace(bits=bits, pack_dtype=torch.int32))  # what a v1 checkpoint stores: zeros - 1
    tensors = {
        "qweight": m.qweight.clone(),
        "qzeros": m.qzeros.clone(),
        "scales": m.scales.clone(),
        "g_idx": m.g_idx.clone().int(),
    }
    return tensors, ref


def _scheme(bits, gs, sym, desc_act):
    return qc.read_scheme({"quant_method": "gptq", "bits": bits, "group_size": gs, "sym": sym, "desc_act": desc_act})


def _block_values(qt) -> torch.Tensor:
    """What the repacked blocks stand for, by gguf-py's dequantizer, in the weight's column order."""
    vals = gguf.quants.dequantize(qt.data.numpy(), gguf.GGMLQuantizationType[qt.fmt]).reshape(qt.shape)
    vals = torch.from_numpy(np.ascontiguousarray(vals))
    if qt.col_perm is not None:
        vals = vals[:, qt.col_perm.argsort()]
    return vals


CASES = [
    (4, 128, True, False),
    (4, 128, True, True),
    (4, 64, False, True),
    (4, 32, False, False),
    (4, -1, True, False),
    (8, 128, True, True),
    (8, 32, False, False),
]


@pytest.mark.parametrize("bits,gs,sym,desc_act", CASES)
def test_dequantization_equals_gptqmodels(bits, gs, sym, desc_act):
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(bits + gs)) * 0.05
    w[3, :40] *= 20  # an outlier group
    tensors, ref = gptq_linear(w, bits, gs, sym, desc_act)
    u = qc.unpack(_scheme(bits, gs, sym, desc_act), "layer", tensors)
    ours = u.dequantize()
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))
    assert (u.g_idx is not None) == desc_act
    fmt, why = qc.choose_format(u, bits)
    if bits == 8 and not sym:
        assert fmt is None and "Q8_0" in why  # loaded as float, logged
        return
    assert fmt == ("Q8_0" if bits == 8 else "Q4_0" if sym else "Q5_0")
    qt = qc.repack(u, fmt)
    assert qt.nbytes <= 1.25 * sum(t.numel() * t.element_size() for t in tensors.values())
    assert torch.equal(_block_values(qt), ours)  # lossless: the blocks mean exactly the checkpoint's values


# -- whole models ---------------------------------------------------------------------------------


def _build(family: str, tok, seed: int = 0):
    import transformers as tf

    common = dict(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    cfg = (
        tf.LlamaConfig(**common, tie_word_embeddings=False)
        if family == "llama"
        else tf.Qwen2Config(**common, tie_word_embeddings=True)
    )
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if family == "qwen2":  # random biases, so a dropped bias shows
        with torch.no_grad():
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 0.5)
    return model


def write_gptq(model, tok, out, bits: int, gs: int, sym: bool, desc_act: bool):
    """`model` saved as a GPTQ v1 folder; returns transformers' model with every quantized
    linear weight replaced by gptqmodel's dequantization of it."""
    from safetensors.torch import save_file

    ref = copy.deepcopy(model)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    for i, (name, mod) in enumerate(ref.named_modules()):
        if isinstance(mod, torch.nn.Linear) and ".layers." in name:
            tensors, deq = gptq_linear(mod.weight.detach(), bits, gs, sym, desc_act, seed=i)
            del sd[f"{name}.weight"]
            sd.update({f"{name}.{k}": v for k, v in tensors.items()})
            with torch.no_grad():
                mod.weight.copy_(deq)
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    cfg["quantization_config"] = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": gs,
        "sym": sym,
        "desc_act": desc_act,
        "checkpoint_format": "gptq",
    }
    (out / "config.json").write_text(json.dumps(cfg))
    tok.save_pretrained(out)
    return ref


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _nll(logits: torch.Tensor, prompt: list[int]) -> float:
    return torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(prompt[1:])).item()


def _assert_greedy_equals(ref, llm, prompt: list[int]) -> None:
    """16 greedy tokens of our engine equal transformers' generate on `ref`."""
    from pagedllm import SamplingParams

    with torch.no_grad():
        want_tokens = ref.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == want_tokens


def _assert_close(quant: LLM, reference: LLM, prompt: list[int]) -> None:
    """`quant`'s prefill and decode against `reference`'s logits: top-1 >= 98%, perplexity within 0.5%."""
    ref = reference.prompt_logits(prompt)
    for label, got in (("prefill", quant.prompt_logits(prompt)), ("decode", quant.prompt_logits(prompt, chunk_size=1))):
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        ppl_ratio = np.exp(_nll(got, prompt) - _nll(ref, prompt))
        assert top1 >= 0.98, (label, top1)
        assert abs(ppl_ratio - 1) <= 0.005, (label, ppl_ratio)


def float_head_llm(path) -> LLM:
    """The checkpoint quantized, its head kept float: the engine most tests of a checkpoint run
    (a module fixture per checkpoint shares one: loading it again proves nothing more)."""
    return LLM(str(path), dtype="float32", kv_cache_memory_mb=8, keep_float_head=True)


def _assert_close_to_float32(path, prompt: list[int], quant: LLM) -> LLM:
    """Quantized prefill and decode (`quant`: float_head_llm(path)) against our
    dequantize_weights=True float32: top-1 >= 98%, perplexity within 0.5%. Returns the float32
    engine. The head stays float: these are the checkpoint's own blocks on the kernels (the Q8_0
    head: test_float_head_is_quantized_...)."""
    exact = LLM(str(path), dtype="float32", kv_cache_memory_mb=8, dequantize_weights=True)
    _assert_close(quant, exact, prompt)
    return exact


@pytest.fixture(
    scope="module",
    params=[("llama", 4, 128, True, True), ("qwen2", 4, 128, False, True), ("llama", 8, 64, True, False)],
    ids=lambda p: "-".join(map(str, p)),
)
def gptq_model(request, tmp_path_factory, hf_smollm2_tokenizer):
    family, bits, gs, sym, desc_act = request.param
    _gptqmodel()
    model = _build(family, hf_smollm2_tokenizer)
    out = tmp_path_factory.mktemp(f"gptq-{family}")
    ref = write_gptq(model, hf_smollm2_tokenizer, out, bits, gs, sym, desc_act)
    return out, ref, request.param


@pytest.fixture(scope="module")
def gptq_llm(gptq_model) -> LLM:
    return float_head_llm(gptq_model[0])


def test_model_matches_transformers_on_gptqmodels_weights(gptq_model, gptq_llm, monkeypatch, tune):
    path, ref, (family, bits, gs, sym, desc_act) = gptq_model
    llm = gptq_llm  # exact: float head
    info = llm.engine.weights
    fmt = "Q8_0" if bits == 8 else "Q4_0" if sym else "Q5_0"
    assert info.kernel is not None and info.formats.get(fmt) == 2 * 7, info
    assert f"gptq {bits}-bit g{gs}" in info.reason and "repacked losslessly" in info.reason, info.reason
    prompt = _prompt(80, 5)
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0]
    got = llm.prompt_logits(prompt)  # 80 rows: the dequantize + GEMM route
    assert (got - want).abs().max().item() < 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # Greedy tokens against transformers' generate on the same weights, every step on the repacked
    # blocks' dequantize + GEMM route (the integer kernels round activations to int8: the next test).

    tune(quant_int_rows="0")

    p = _prompt(12, 7)
    _assert_greedy_equals(ref, llm, p)


def test_quantized_execution_against_our_float32(gptq_model, gptq_llm):
    path, _, _ = gptq_model
    exact = _assert_close_to_float32(path, _prompt(160, 11), gptq_llm)
    assert exact.engine.weights.kernel is None and "dequantized to float" in exact.engine.weights.reason


def test_wide_decode_steps_against_our_float32(gptq_model, gptq_llm, monkeypatch, tune):
    """Many sequences decoding together: steps of 9-32 rows, whose activations are one int8
    level except at q|k|v (quant.kernels.X2_WIDE). Against our dequantize_weights=True float32,
    teacher-forced over the same windows: perplexity within 0.5%, and q|k|v's second level cuts
    the logprobs' error by at least a fifth against every projection in one level. (Top-1 is not
    held here: these random layers' near-flat top-1s flip at 4-6% with any int8 rounding of
    the wide layers; `bench quality --weights` holds a real GPTQ model to 98%: docs/design/activation-rounding.md.)"""
    from pagedllm.quant import kernels as qk

    tune(quant_act="auto")
    tune(quant_x2_wide=None)
    path, _, _ = gptq_model
    windows = [_prompt(40, 100 + i) for i in range(16)]
    assert qk.X2_ROWS < len(windows) <= qk.int_rows() and qk.X2_WIDE == ("qkv_proj",)
    exact = LLM(str(path), dtype="float32", kv_cache_memory_mb=8, dequantize_weights=True)
    want = torch.cat(exact.score_prompts(windows, chunk_size=1))
    got = torch.cat(gptq_llm.score_prompts(windows, chunk_size=1))
    assert abs(float(torch.exp(want.double().mean() - got.double().mean())) - 1) <= 0.005
    tune(quant_x2_wide="")
    one_level = torch.cat(gptq_llm.score_prompts(windows, chunk_size=1))
    err, err_one = (got - want).abs().mean().item(), (one_level - want).abs().mean().item()
    assert err <= 0.8 * err_one, (err, err_one)


def test_float_head_is_quantized_to_q8_0_at_load(gptq_model, gptq_llm):
    """GPTQ tools leave the LM head (qwen2 here: the tied embedding, which is the head) in float,
    where a 0.5B model's head is as many bytes a token as all its 4-bit layers: it is quantized to
    Q8_0 at load, as llama.cpp keeps a 4-bit file's head, within the float head's quality;
    keep_float_head=True keeps it float. (Tied, the embedding's rows are Q8_0 too, as in a GGUF:
    these random layers amplify that input change until 6-8% of their near-flat top-1s over
    49k tokens flip (median top-2 gap 0.2 of a logit std of 1.6), so there only the perplexity is
    held; `bench quality --weights --head` holds a real model to both.)"""
    path, _, (family, *_) = gptq_model
    quant = LLM(str(path), dtype="float32", kv_cache_memory_mb=8)
    model = quant.engine.model
    assert model.lm_head.weight is None and [p.fmt for p in model.lm_head.qparts] == ["Q8_0"]
    if family == "qwen2":  # tied: the embedding reads the same blocks
        assert model.embed_tokens.qweight is not None and model.embed_tokens.qweight.fmt == "Q8_0"
        assert model.lm_head.qparts[0].data is model.embed_tokens.qweight.data
    else:  # untied: the embedding is only row-gathered; it stays float
        assert model.embed_tokens.qweight is None and model.embed_tokens.weight.dtype == torch.float32
    assert "quantized to Q8_0 at load" in quant.engine.weights.reason
    kept = gptq_llm
    head = kept.engine.model.lm_head
    assert head.qparts is None and head.weight.dtype == torch.float32
    prompt = _prompt(160, 13)
    if family != "qwen2":
        _assert_close(quant, kept, prompt)
    else:
        want = kept.prompt_logits(prompt)
        for got in (quant.prompt_logits(prompt), quant.prompt_logits(prompt, chunk_size=1)):
            assert abs(np.exp(_nll(got, prompt) - _nll(want, prompt)) - 1) <= 0.005


# -- bad input ---------------------------------------------------------------------------------------


def test_bad_checkpoints_name_the_tensor_or_key(tmp_path):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    tensors, _ = gptq_linear(w, 4, 32, True, True)
    with pytest.raises(QuantFormatError, match=r"quantization_config.bits = 3"):
        qc.read_scheme({"quant_method": "gptq", "bits": 3, "group_size": 128})
    with pytest.raises(QuantFormatError, match=r"quant_method = 'hqq' is not supported"):
        qc.read_scheme({"quant_method": "hqq"})
    bad = dict(tensors, g_idx=tensors["g_idx"].clone())
    bad["g_idx"][:5] = 0  # group 0 now has more columns than its share
    with pytest.raises(QuantFormatError, match=r"layer.g_idx is not a permutation of groups"):
        qc.unpack(_scheme(4, 32, True, True), "layer", bad)
    with pytest.raises(QuantFormatError, match=r"layer.qzeros is missing"):
        qc.unpack(_scheme(4, 32, True, True), "layer", {k: v for k, v in tensors.items() if k != "qzeros"})
    with pytest.raises(QuantFormatError, match=r"layer.qweight: group_size 48 .* does not divide its 128"):
        qc.unpack(_scheme(4, 48, True, False), "layer", tensors)


def test_unknown_method_in_a_folder_is_refused(gptq_model, tmp_path):
    import shutil

    path, _, _ = gptq_model
    bad = tmp_path / "m"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "exl9"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantFormatError, match=r"quantization_config.quant_method = 'exl9'"):
        LLM(str(bad), dtype="float32", kv_cache_memory_mb=8)
