"""pagedllm: an LLM inference engine built around a paged KV cache."""
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
