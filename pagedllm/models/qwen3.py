"""Qwen3: Llama with an RMSNorm over each q and k head before rope, and no q/k/v bias."""

from .llama import DecoderLayer, LlamaForCausalLM, RMSNorm


class Qwen3DecoderLayer(DecoderLayer):
    qk_norm = RMSNorm
    stack_decode = True  # the all-layer decode applies the q/k norms too


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
