"""AWQ checkpoints in the GEMM layout (nibble order 0 2 4 6 1 3 5 7): packed by autoawq's own
WQLinear_GEMM, held to autoawq's dequantize_gemm bit for bit, and run as a model against
transformers on autoawq's dequantized weights and against our float32 run."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from pagedllm import LLM
from pagedllm.quant import checkpoint as qc
from pagedllm.quant.kernels import available_isas

from test_gptq import _assert_close_to_float32, _assert_greedy_equals, _block_values, _build, _prompt, float_head_llm

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not available_isas(), reason="native CPU kernels not built here")]


def _awq():
    gemm = pytest.importorskip("awq.modules.linear.gemm")
    packing = pytest.importorskip("awq.utils.packing_utils")
    return gemm.WQLinear_GEMM, packing.dequantize_gemm


def awq_linear(lin: torch.nn.Linear, gs: int):
    """(checkpoint tensors, autoawq's dequantization [out, in] in float32) of a float layer: min/max
    scales and zeros per group as AWQ's pseudo-quantizer picks them, packed by WQLinear_GEMM."""
    WQLinear_GEMM, dequantize_gemm = _awq()
    w = lin.weight.detach()
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // gs, gs)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo).clamp(min=1e-5) / 14).half().float()  # a level of margin: the packer does not clamp
    zeros = torch.clamp(-torch.round(lo / scales), 0, 15)
    m = WQLinear_GEMM.from_linear(lin, 4, gs, scales=scales.t().contiguous(), zeros=zeros.t().contiguous())
    tensors = {"qweight": m.qweight.clone(), "qzeros": m.qzeros.clone(), "scales": m.scales.clone()}
    # autoawq's dequantization, with the scales widened to float32 (exact products)
    ref = dequantize_gemm(m.qweight, m.qzeros, m.scales.float(), 4, gs).t().contiguous()
    assert torch.equal(ref.half(), dequantize_gemm(m.qweight, m.qzeros, m.scales, 4, gs).t())
    return tensors, ref


def _scheme(gs):
    return qc.read_scheme({"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True, "version": "gemm"})


@pytest.mark.parametrize("gs", [32, 64, 128])
def test_dequantization_equals_autoawqs(gs):
    lin = torch.nn.Linear(256, 96, bias=False)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(gs))
    tensors, ref = awq_linear(lin, gs)
    u = qc.unpack(_scheme(gs), "layer", tensors)
    ours = u.dequantize()
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))
    fmt, _ = qc.choose_format(u, 4)
    assert fmt == "Q5_0"
    assert torch.equal(_block_values(qc.repack(u, fmt)), ours)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def awq_model(request, tmp_path_factory, hf_smollm2_tokenizer):
    from safetensors.torch import save_file

    _awq()
    tok = hf_smollm2_tokenizer
    model = _build(request.param, tok)
    ref = copy.deepcopy(model)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    for name, mod in ref.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in name:
            tensors, deq = awq_linear(mod, 128)
            del sd[f"{name}.weight"]
            sd.update({f"{name}.{k}": v for k, v in tensors.items()})
            with torch.no_grad():
                mod.weight.copy_(deq)
    out = tmp_path_factory.mktemp(f"awq-{request.param}")
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    cfg["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
    }
    (out / "config.json").write_text(json.dumps(cfg))
    tok.save_pretrained(out)
    return out, ref


@pytest.fixture(scope="module")
def awq_llm(awq_model) -> LLM:
    return float_head_llm(awq_model[0])


def test_model_matches_transformers_on_autoawqs_weights(awq_model, awq_llm, monkeypatch, tune):

    path, ref = awq_model
    llm = awq_llm  # exact: float head
    info = llm.engine.weights
    assert info.kernel is not None and info.formats.get("Q5_0") == 14 and "awq 4-bit g128" in info.reason
    prompt = _prompt(80, 6)
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0]
    got = llm.prompt_logits(prompt)
    assert (got - want).abs().max().item() < 1e-3
    tune(quant_int_rows="0")
    p = _prompt(12, 8)
    _assert_greedy_equals(ref, llm, p)


def test_quantized_execution_against_our_float32(awq_model, awq_llm):
    path, _ = awq_model
    _assert_close_to_float32(path, _prompt(160, 13), awq_llm)


@pytest.fixture(scope="module")
def autoawq_checkpoint(tmp_path_factory, hf_smollm2_tokenizer):
    """A Llama quantized by autoawq's own AWQ search (on the CPU, a short calibration text)."""
    awq = pytest.importorskip("awq")
    tok = hf_smollm2_tokenizer
    src = tmp_path_factory.mktemp("awq-src")
    _build("llama", tok).save_pretrained(src)
    tok.save_pretrained(src)
    model = awq.AutoAWQForCausalLM.from_pretrained(str(src), device_map="cpu")
    texts = ["The quick brown fox jumps over the lazy dog while the cat sleeps by the fire. " * 2] * 16
    model.quantize(
        tok,
        quant_config={"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"},
        calib_data=texts,
        max_calib_samples=16,
        max_calib_seq_len=64,
    )
    out = tmp_path_factory.mktemp("awq-q")
    model.save_quantized(str(out))
    tok.save_pretrained(out)
    return src, out


def test_autoawqs_own_checkpoint(autoawq_checkpoint):
    """autoawq's search rescales the norms and weights it quantizes: transformers gets every float
    tensor of the checkpoint and autoawq's dequantize_gemm of every quantized one."""
    import transformers as tf
    from safetensors.torch import load_file

    _, dequantize_gemm = _awq()
    src, path = autoawq_checkpoint
    sd = load_file(str(path / "model.safetensors"))
    scheme = qc.read_scheme(json.loads((path / "config.json").read_text())["quantization_config"])
    ref = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    prefixes = [k.removesuffix(".qweight") for k in sd if k.endswith(".qweight")]
    assert len(prefixes) == 14
    with torch.no_grad():
        for p in prefixes:
            parts = {s: sd[f"{p}.{s}"] for s in ("qweight", "qzeros", "scales")}
            lib = dequantize_gemm(parts["qweight"], parts["qzeros"], parts["scales"].float(), 4, 128).t().contiguous()
            ours = qc.unpack(scheme, p, parts).dequantize()
            assert torch.equal(ours.view(torch.int32), lib.view(torch.int32)), p
            ref.get_submodule(p).weight.copy_(lib)
        for k, v in sd.items():
            if not k.endswith((".qweight", ".qzeros", ".scales")):
                ref.get_parameter(k).copy_(v.float())
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=8, keep_float_head=True)
    assert llm.engine.weights.formats.get("Q5_0") == 14
    prompt = _prompt(80, 1)
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0]
    got = llm.prompt_logits(prompt)
    assert (got - want).abs().max().item() < 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))
