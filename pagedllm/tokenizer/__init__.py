"""Tokenization: a wrapper over `tokenizers`, chat templates and streaming detokenization."""

from pagedllm.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerLoadError

__all__ = ["IncrementalDetokenizer", "Tokenizer", "TokenizerLoadError"]
