"""The architectures a GGUF file may hold, and how its tensors are named under transformers'
(HF) names per architecture: the tables, the mapping and llama.cpp's q/k row permutation undone."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

# GGUF architecture -> (HF architecture class, HF model_type).
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    # Mixtures of experts ("llama" with an expert_count is Mixtral)
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "olmoe": ("OlmoeForCausalLM", "olmoe"),
}
_MIXTRAL = ("MixtralForCausalLM", "mixtral")
# How llama.cpp routes each MoE architecture: whether the top-k weights are renormalized
# (its build_moe_ffn's norm_w), unless the file says (expert_weights_norm).
_MOE_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
# llama.cpp's converter permutes Q/K rows of these architectures for its interleaved rope.
_PERMUTED_QK_ARCHS = {"llama", "mistral"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # MoE: the router, and Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# All of a layer's experts in one 3-D tensor [experts, rows, cols] (GGUF order: cols, rows,
# experts); each expert is handed on as its own HF-named matrix.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Older Mixtral files: one tensor per expert, blk.N.ffn_gate.E.weight.
_PER_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
# Gemma's layers have four norms; llama.cpp names them apart from Llama's two.
_GEMMA_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# The Gemma family: llama.cpp stores their norms as 1 + weight, names their layer norms apart
# (above), and gives their SentencePiece vocabularies byte tokens (tokenizer.py). One table for
# all three uses; gemma and gemma2 reach the first two only through LoRA adapter files.
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
# Tensors llama.cpp stores that have no HF parameter (rope_freqs feeds config.rope_scaling instead).
_NON_HF_TENSORS = {"rope_freqs.weight"}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def _hf_tensor_names(tensor: Any, arch: str) -> list[tuple[str, int | None]]:
    """The HF names a file tensor is handed on under, with the expert index of each where the
    tensor holds experts (a 3-D tensor: one name per expert)."""
    match = _LAYER_TENSOR_RE.fullmatch(tensor.name)
    if match and match.group(2) in _EXPERT_TENSORS and len(tensor.shape) == 3:
        layer, part, _ = match.groups()
        return [
            (f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_TENSORS[part]}.weight", e)
            for e in range(int(tensor.shape[2]))
        ]
    per_expert = _PER_EXPERT_RE.fullmatch(tensor.name)
    if per_expert:
        layer, part, e = per_expert.groups()
        return [(f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight", int(e))]
    hf = _hf_tensor_name(tensor.name, arch)
    return [] if hf is None else [(hf, None)]


def _hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    names = _GEMMA_LAYER_TENSORS if arch in _GEMMA_ARCHS else _LAYER_TENSORS
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match and match.group(2) in names:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{names[part]}.{kind}"
    return None


def _undo_rope_permute(array: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation (it interleaves each head's two rotary halves).

    llama.cpp reorders each head's rows from [first half, second half] to pairs (x0, x_half, x1, ...);
    HF's rotate_half wants the halves back, so view rows as (head, pair, 2) and swap the last two axes.
    """
    rows = array.shape[0]
    half = rows // n_heads // 2
    return array.reshape(n_heads, half, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


# --------------------------------------------------------------------------------------------------
