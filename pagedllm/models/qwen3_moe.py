"""Qwen3-MoE: Qwen3's attention (an RMSNorm over each q and k head) with sparse MoE blocks;
`decoder_sparse_step` and `mlp_only_layers` leave some layers with a dense MLP, and
`norm_topk_prob` renormalizes the top-k routing weights (models/moe.py)."""

from .llama import RMSNorm
from .moe import MoeDecoderLayer, MoeForCausalLM


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    qk_norm = RMSNorm
    stack_decode = True  # the all-layer decode applies the q/k norms too


class Qwen3MoeForCausalLM(MoeForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
