"""Mixtral: Mistral's attention (a sliding window where the config sets one) with a sparse
MoE block in every layer: top-k of the router's softmax, renormalized (models/moe.py).

Checkpoints name the block `block_sparse_moe` and an expert's projections w1 (gate), w3 (up)
and w2 (down); the name map turns them into the shared block's names.
"""

from .moe import MoeDecoderLayer, MoeForCausalLM


class MixtralDecoderLayer(MoeDecoderLayer):
    weights_in_compute_dtype = False  # transformers scales by the float32 weights
    stack_decode = True


class MixtralForCausalLM(MoeForCausalLM):
    layer_cls = MixtralDecoderLayer
