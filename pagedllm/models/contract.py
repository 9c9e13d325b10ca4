"""What a model family is to the rest of the engine, declared once: the members every family
has (`CausalLM`), what a vision-language family adds (`VisionLM`) and an M-RoPE one on top
(`MRopeLM`). A family says which it is by its class attributes `vision` and `mrope`; the
engine reads those instead of probing for methods, and `check_contract` holds the family to
what it declared where the model is built (loading/loader.py)."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch


class CausalLM(Protocol):
    config: Any  # the ModelConfig it was built from
    rope: Any  # the rotary tables (their length bounds max_model_len)
    lm_head: torch.nn.Module | None  # None: a head-less embedding model, or a pipeline stage without it
    pipeline_stages: ClassVar[bool]  # whether the family can be cut into pipeline stages
    vision: ClassVar[bool]  # a vision-language model: VisionLM's members too
    mrope: ClassVar[bool]  # image prompts rotate by positions of their own: MRopeLM's members too

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, **kw: Any) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None: ...
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...
    def attention_modules(self) -> list: ...
    def expert_paths(self) -> list: ...  # a mixture of experts' routed blocks (empty for a dense model)
    def map_weight_name(self, name: str) -> Any: ...
    def load_weights(self, weights: Any, *args: Any, **kw: Any) -> Any: ...
    def drop_head(self) -> None: ...


class VisionLM(CausalLM, Protocol):
    image_token_id: int  # the placeholder token an image's embedding rows replace
    bidirectional_images: ClassVar[bool]  # an image's tokens attend to the whole image
    image_layout: ClassVar[str]  # how placeholders are laid out per image (multimodal/processor.py)

    def encode_images(self, pixels: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]: ...


class MRopeLM(VisionLM, Protocol):
    def rope_index(self, mm: Any) -> Any: ...


def _members(protocol: type) -> list[str]:
    names: list[str] = []
    for klass in protocol.__mro__:
        if klass in (Protocol, object) or not getattr(klass, "_is_protocol", False):
            continue
        names += [n for n in (*klass.__dict__.get("__annotations__", {}), *vars(klass)) if not n.startswith("_")]
    return sorted(set(names))


def check_contract(model: Any) -> None:
    """Raise TypeError naming what `model` lacks of the contract its class declares."""
    wanted = [CausalLM]
    if model.vision:
        wanted.append(VisionLM)
    if model.mrope:
        wanted.append(MRopeLM)
    for protocol in wanted:
        missing = [n for n in _members(protocol) if not hasattr(model, n)]
        if missing:
            raise TypeError(f"{type(model).__name__} declares {protocol.__name__} but lacks {', '.join(missing)}")
