"""pagedllm: an LLM inference engine built around a paged KV cache."""
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling.params import SamplingParams

# The mistral.rs-style API pulls in pydantic (its requests are the server's models): imported
# on first use, so a process that only runs LLM does not carry it.
_API_NAMES = ("Architecture", "ChatCompletionRequest", "CompletionRequest", "PagedCacheType", "Runner", "Which")

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", *_API_NAMES]
from ._version import __version__


def __getattr__(name: str):
    if name in _API_NAMES:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
