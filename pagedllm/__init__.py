"""pagedllm: an LLM inference engine built around a paged KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__ as __version__

# Everything is imported on first use: `import pagedllm` alone loads neither torch nor pydantic,
# so the CLI can refuse bad input (a busy port, a bad flag) before the second or more they take.
_NAMES = {
    "LLM": "llm",
    "SamplingParams": "sampling.params",
    "LoRARequest": "lora.request",
    "RequestOutput": "outputs",
    "CompletionOutput": "outputs",
    # The mistral.rs-style API pulls in pydantic (its requests are the server's models).
    **{
        name: "api"
        for name in ("Architecture", "ChatCompletionRequest", "CompletionRequest", "PagedCacheType", "Runner", "Which")
    },
}

__all__ = list(_NAMES)

if TYPE_CHECKING:
    from .llm import LLM as LLM
    from .lora.request import LoRARequest as LoRARequest
    from .outputs import CompletionOutput as CompletionOutput, RequestOutput as RequestOutput
    from .sampling.params import SamplingParams as SamplingParams


def __getattr__(name: str):
    if name in _NAMES:
        import importlib

        value = getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
