"""A mixture of experts on real weights: `bench upcycle` copies the real SmolLM2 GGUF's MLP into
every expert of a Mixtral-layout file (its Q4_1 bytes unchanged, a random F32 router). Each
row's routing weights sum to one over copies of one function, so the MoE model must compute
what the dense model computes: transformers' float32 reading of the dense file is the
reference, and the MoE paths (3-D expert tensors, router, top k, expert kernels, weighted sum)
run on real activations instead of random ones."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.upcycle import upcycle

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory, smollm2_gguf_path):
    path = tmp_path_factory.mktemp("upcycle") / "smollm2-4x.gguf"
    upcycle(smollm2_gguf_path, path, experts=4, used=2, seed=3)
    return path


def test_the_file_holds_the_dense_bytes_in_every_expert(moe_file, smollm2_gguf_path):
    dense = {t.name: t for t in gguf.GGUFReader(str(smollm2_gguf_path)).tensors}
    moe = gguf.GGUFReader(str(moe_file))
    assert moe.fields["llama.expert_count"].contents() == 4
    assert moe.fields["llama.expert_used_count"].contents() == 2
    tensors = {t.name: t for t in moe.tensors}
    up = tensors["blk.7.ffn_up_exps.weight"]
    assert up.tensor_type == dense["blk.7.ffn_up.weight"].tensor_type
    for e in range(4):
        assert np.array_equal(up.data[e], dense["blk.7.ffn_up.weight"].data)
    assert tuple(tensors["blk.7.ffn_gate_inp.weight"].shape) == (576, 4)
    assert "blk.7.ffn_up.weight" not in tensors
    assert np.array_equal(tensors["blk.7.attn_q.weight"].data, dense["blk.7.attn_q.weight"].data)


def _hf_greedy(model, tok, prompt: str, n: int) -> list[int]:
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return out[0, ids.shape[1] :].tolist()


def test_dequantized_moe_generates_transformers_dense_tokens(moe_file, hf_smollm2_model, hf_smollm2_tokenizer):
    llm = LLM(str(moe_file), dtype="float32", dequantize_weights=True)
    assert type(llm.engine.model).__name__ == "MixtralForCausalLM"
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        want = _hf_greedy(hf_smollm2_model, hf_smollm2_tokenizer, prompt, 24)  # (to its EOS, if any)
        assert len(want) >= 10 and out.outputs[0].token_ids[: len(want)] == want, prompt


def test_quantized_experts_follow_the_dense_model(moe_file, smollm2_gguf_path):
    """The quantized route on both sides (the same int8 kernels over the same bytes): the greedy
    tokens agree, and where they part the dense model had a near tie there. Batch 4 decodes
    through the few-row native MoE block; the prompts' prefill through the grouped route."""
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    dense = LLM(str(smollm2_gguf_path), dtype="float32").generate(PROMPTS, sp)
    moe = LLM(str(moe_file), dtype="float32").generate(PROMPTS, sp)
    equal = 0
    for d, m in zip(dense, moe):
        a, b = d.outputs[0], m.outputs[0]
        i = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if i is None:
            equal += 1
            continue
        top = a.logprobs[i]["top"]
        assert abs(top[0][1] - top[1][1]) < 0.05, (d.prompt, i, top)
        assert b.token_ids[i] in (top[0][0], top[1][0])
    assert equal >= len(PROMPTS) - 1


def test_refuses_what_it_cannot_upcycle(tmp_path, moe_file):
    with pytest.raises(ValueError, match="already a mixture of experts"):
        upcycle(moe_file, tmp_path / "again.gguf")
    with pytest.raises(ValueError, match="between 1 and"):
        upcycle(moe_file, tmp_path / "x.gguf", experts=2, used=3)
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        upcycle(text, tmp_path / "y.gguf")
