"""pagedllm: an LLM inference engine built around a paged KV cache."""
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling.params import SamplingParams
from .api import Architecture, ChatCompletionRequest, CompletionRequest, PagedCacheType, Runner, Which

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput",
           "Runner", "Which", "ChatCompletionRequest", "CompletionRequest", "Architecture",
           "PagedCacheType"]
__version__ = "0.1.0"
