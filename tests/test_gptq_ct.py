"""compressed-tensors `pack-quantized` checkpoints (W4A16, W8A16), made by llmcompressor's GPTQ
from random-weight Llama and Qwen2 models with a short calibration text: our dequantization
against compressed-tensors' own, bit for bit, our model against transformers running the
checkpoint through compressed-tensors, and our quantized execution against our float32."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM
from pagedllm.quant import checkpoint as qc
from pagedllm.quant.kernels import available_isas

from test_gptq import _assert_close_to_float32, _assert_greedy_equals, _block_values, _prompt, float_head_llm

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not available_isas(), reason="native CPU kernels not built here")]

CALIBRATION = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps by the fire. " * 6,
    "Paged attention keeps the key and value cache in fixed-size blocks of tokens. " * 6,
]


def make_checkpoint(family: str, scheme: str, tok, out):
    """llmcompressor's one-shot GPTQ of a random bf16 model (bf16, as hub checkpoints are: its
    scales fit the blocks' fp16 exactly), saved compressed."""
    pytest.importorskip("compressed_tensors")
    llmc = pytest.importorskip("llmcompressor")
    from datasets import Dataset
    from llmcompressor.modifiers.quantization import GPTQModifier

    from test_gptq import _build

    src = out.parent / f"{out.name}-float"
    _build(family, tok).save_pretrained(src)
    tok.save_pretrained(src)
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    ds = Dataset.from_dict({"input_ids": [tok(t)["input_ids"][:128] for t in CALIBRATION]})
    recipe = GPTQModifier(targets="Linear", scheme=scheme, ignore=["lm_head"], actorder="weight")
    llmc.oneshot(
        model=model,
        processor=tok,
        dataset=ds,
        recipe=recipe,
        max_seq_length=128,
        num_calibration_samples=len(CALIBRATION),
    )
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(
    scope="module", params=[("llama", "W4A16"), ("qwen2", "W8A16"), ("llama", "W4A16_ASYM")], ids=lambda p: "-".join(p)
)
def ct_model(request, tmp_path_factory, hf_smollm2_tokenizer):
    family, scheme = request.param
    out = make_checkpoint(family, scheme, hf_smollm2_tokenizer, tmp_path_factory.mktemp("ct") / "q")
    return out, request.param


@pytest.fixture(scope="module")
def ct_llm(ct_model) -> LLM:
    return float_head_llm(ct_model[0])


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _ct_dequantized(path) -> dict[str, torch.Tensor]:
    """Each quantized weight by compressed-tensors' own unpacking and dequantization, its scales
    widened to float32 (so the products are exact)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    qcfg = json.loads((path / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs(**qcfg["config_groups"]["group_0"]["weights"])
    sd = _tensors(path)
    out = {}
    for p in [k.removesuffix(".weight_packed") for k in sd if k.endswith(".weight_packed")]:
        shape = torch.Size(sd[f"{p}.weight_shape"].tolist())
        q = unpack_from_int32(sd[f"{p}.weight_packed"], args.num_bits, shape)
        zp = sd.get(f"{p}.weight_zero_point")
        if zp is not None:
            zp = unpack_from_int32(
                zp, args.num_bits, torch.Size([shape[0], sd[f"{p}.weight_scale"].shape[1]]), packed_dim=0
            )
        out[p] = dequantize(q, sd[f"{p}.weight_scale"].float(), zp, args, dtype=torch.float32)
    return out


def test_dequantization_equals_compressed_tensors(ct_model):
    path, (family, scheme) = ct_model
    qcfg = json.loads((path / "config.json").read_text())["quantization_config"]
    ours_scheme = qc.read_scheme(qcfg)
    sd = _tensors(path)
    refs = _ct_dequantized(path)
    assert len(refs) == 14
    fmts = set()
    for p, ref in refs.items():
        parts = {k.removeprefix(p + "."): v for k, v in sd.items() if k.startswith(p + ".")}
        u = qc.unpack(ours_scheme, p, parts)
        ours = u.dequantize()
        assert torch.equal(ours.view(torch.int32), ref.view(torch.int32)), p
        fmt, why = qc.choose_format(u, ours_scheme.bits)
        assert fmt is not None, (p, why)
        fmts.add(fmt)
        assert torch.equal(_block_values(qc.repack(u, fmt)), ours), p
    assert fmts == {{"W4A16": "Q4_0", "W8A16": "Q8_0", "W4A16_ASYM": "Q5_0"}[scheme]}


def test_model_matches_transformers_running_the_checkpoint(ct_model, ct_llm, monkeypatch, tune):
    import transformers as tf

    path, (family, scheme) = ct_model
    ref = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=tf.CompressedTensorsConfig(run_compressed=False)
    ).eval()
    # transformers decompresses through compressed-tensors into the scales' bf16: the exact values,
    # rounded once. Its model then runs on the exact float32 values, as ours does.
    with torch.no_grad():
        for p, exact in _ct_dequantized(path).items():
            mod = ref.get_submodule(p)
            assert torch.equal(mod.weight, exact.bfloat16().float()), p
            mod.weight.copy_(exact)
    llm = ct_llm  # exact: float head
    info = llm.engine.weights
    assert info.kernel is not None and "compressed-tensors" in info.reason and "float" not in info.reason.split(";")[-1]
    prompt = _prompt(80, 3)
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0]
    got = llm.prompt_logits(prompt)
    assert (got - want).abs().max().item() < 1e-3
    tune(quant_int_rows="0")  # every step on the blocks' dequantize + GEMM route
    p = _prompt(12, 4)
    _assert_greedy_equals(ref, llm, p)


def test_quantized_execution_against_our_float32(ct_model, ct_llm):
    path, _ = ct_model
    _assert_close_to_float32(path, _prompt(160, 12), ct_llm)
