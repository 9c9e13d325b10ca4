"""What request translation needs to know about the loaded model and its cache."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServingContext:
    """What request preparation needs to know about the loaded model and its cache."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    block_size: int
    usable_blocks: int
    max_n: int
    vocab_size: int | None = None  # the logits' width (logit_bias ids must fall below it)
    # A vision-language model's image processor (pagedllm/multimodal) and where images may come
    # from; None: a text-only model.
    processor: Any = None
    media_policy: Any = None
    started: float = field(default_factory=time.time)  # when serving began: the models' creation time

    @classmethod
    def from_llm(cls, llm: Any, model_name: str | None = None, max_n: int | None = None) -> "ServingContext":
        eng = llm.engine
        return cls(
            tokenizer=llm.tokenizer,
            model_name=model_name or llm.model_name,
            max_model_len=eng.sched_config.max_model_len,
            block_size=eng.cache_config.block_size,
            usable_blocks=eng.block_manager.num_usable_blocks,
            max_n=max_n or min(128, eng.sched_config.max_num_seqs),
            vocab_size=eng.model_config.vocab_size,
            processor=getattr(llm, "processor", None),
            media_policy=getattr(llm, "media_policy", None),
        )

    def default_max_tokens(self, prompt_len: int, n: int) -> int:
        """Without max_tokens a request may run to the context end, as far as the cache can hold
        n copies of it (a larger default would be refused as never fitting)."""
        room = min(self.max_model_len, self.usable_blocks * self.block_size // max(n, 1))
        return max(1, room - prompt_len)

    def capped_max_tokens(self, prompt_len: int, asked: int | None) -> int:
        """An output limit read as a ceiling (Anthropic's max_tokens, Ollama's num_predict): at
        most the room the context and the cache leave after the prompt; the answer that reaches
        it ends as cut at its limit, as llama.cpp and Ollama serve it."""
        room = self.default_max_tokens(prompt_len, 1)
        return room if asked is None else min(asked, room)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
