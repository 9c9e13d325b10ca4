"""Mistral: the Llama architecture with a sliding attention window on every layer.

The window is read from the config into `ModelConfig.layer_windows`; the model
code is Llama's unchanged.
"""

from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
