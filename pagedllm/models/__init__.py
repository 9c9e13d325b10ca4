"""Model families by the architecture name found in config.json."""
from __future__ import annotations

from .llama import LlamaForCausalLM
from .mistral import MistralForCausalLM
from .qwen2 import Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def model_class(architecture: str) -> type:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unknown model architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None
