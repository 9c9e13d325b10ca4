"""GGUF files of the newer families (qwen3, gemma3), written here with the gguf package from
a random-weight transformers model, against transformers loading the same file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from test_gguf import _spm_vocab

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

Q = gguf.GGMLQuantizationType
WINDOW = 32
# HF parameter name part -> llama.cpp tensor name part.
_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}
_QWEN = {**_NAMES, "post_attention_layernorm": "ffn_norm"}
_GEMMA = {
    **_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _hf_model(arch: str, vocab: int):
    """transformers reads no head_dim (qwen3) or query_pre_attn_scalar (gemma3) from GGUF and
    takes its defaults (128; 256): the models use those values."""
    import transformers as tf

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "qwen3":
        cfg = tf.Qwen3Config(**common, num_hidden_layers=2, head_dim=128, rope_theta=1e6, tie_word_embeddings=True)
    else:  # layer 5 is global, as llama.cpp and transformers assume for gemma3 files
        cfg = tf.Gemma3TextConfig(
            **common,
            num_hidden_layers=6,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=WINDOW,
            sliding_window_pattern=6,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    return model


def _write_gguf(path, arch: str, model, qtype) -> None:
    """As llama.cpp's converter writes these architectures (no q/k permutation for either;
    Gemma's norms stored as 1 + weight); matrices in `qtype`."""
    cfg = model.config
    tokens, types, scores = _spm_vocab()
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(1e6)
    w.add_vocab_size(len(tokens))
    if arch == "gemma3":
        w.add_sliding_window(WINDOW)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    names = _GEMMA if arch == "gemma3" else _QWEN
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        a = t.numpy().astype(np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            a = a + 1
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            part, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{names[part]}.{kind}"
        if a.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,qtype", [("qwen3", Q.F32), ("qwen3", Q.Q8_0), ("gemma3", Q.F32), ("gemma3", Q.Q8_0)])
def test_gguf_greedy_tokens_match_transformers(tmp_path, arch, qtype):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    vocab = len(_spm_vocab()[0])
    _write_gguf(tmp_path / "m.gguf", arch, _hf_model(arch, vocab), qtype)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32
    ).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 40, 97)]  # two past the window
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(p) :].tolist())
    # The float weights transformers holds (dequantized from the file's blocks).
    llm = LLM(str(tmp_path / "m.gguf"), dtype="float32", kv_cache_memory_mb=16, dequantize_weights=True)
    with torch.no_grad():
        want = ref(torch.tensor([prompts[-1]])).logits[0]
    err = (llm.prompt_logits(prompts[-1]) - want).abs().max().item()
    assert err < 1e-4, f"{arch} {qtype.name}: prefill logits differ by {err}"
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == expected
