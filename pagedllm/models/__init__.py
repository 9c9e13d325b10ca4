"""Model families by the architecture name found in config.json."""

from __future__ import annotations

import torch

from .gemma2 import Gemma2ForCausalLM
from .gemma3 import Gemma3ForCausalLM
from .gemma3_vl import Gemma3ForConditionalGeneration
from .idefics3 import Idefics3ForConditionalGeneration
from .llama import LlamaForCausalLM
from .mistral import MistralForCausalLM
from .mixtral import MixtralForCausalLM
from .olmoe import OlmoeForCausalLM
from .phi3 import Phi3ForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from .qwen2_moe import Qwen2MoeForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    # Vision-language models (pagedllm/multimodal)
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    # Mixtures of experts (models/moe.py)
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
}


def model_class(architecture: str) -> type:
    """The family's class; a base model without its LM head (`Qwen3Model`, as embedding models
    are saved) is its causal-LM family's class, loaded with `drop_head()`."""
    if architecture.endswith("Model") and architecture not in MODEL_REGISTRY:
        architecture = architecture.removesuffix("Model") + "ForCausalLM"
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unknown model architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None


def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Give a model built on the meta device real, uninitialised storage: floating parameters
    and buffers in `dtype`, the rest as they are. Unlike `to_empty(...).to(dtype)` this
    allocates once, in the final dtype, and never calls a meta-device kernel written in
    Python (`empty_like` of a meta tensor imports sympy: about 2 s of every start)."""
    from ..quant.kernels import weight_buffer

    def fresh(t: torch.Tensor, weight: bool = False) -> torch.Tensor:
        dt = dtype if t.is_floating_point() else t.dtype
        # Large CPU weights in 2 MiB pages, as the packed ones (quant/kernels.py weight_buffer):
        # a dense bf16 model's batch-1 decode streams them every step.
        placed = weight_buffer(t.shape, dt) if weight and device.type == "cpu" else None
        return placed if placed is not None else torch.empty(t.shape, dtype=dt, device=device)

    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                mod._parameters[name] = torch.nn.Parameter(fresh(p, weight=True), requires_grad=p.requires_grad)
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = fresh(b)
    return model
