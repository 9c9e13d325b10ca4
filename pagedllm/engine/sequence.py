"""A request's state as the scheduler sees it: tokens, progress, and its block table."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from ..sampling.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One stream of tokens. n > 1 requests own n sequences that share a prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    index: int = 0  # which of the request's n completions
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    first_scheduled_time: float | None = None  # perf_counter() when first admitted (queue time's end)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    # KV groups after the first (kv/groups.py): their block tables and hashes, kept by the
    # block manager; empty for single-group models.
    group_tables: list[list[int]] = field(default_factory=list)
    group_hashes: list[list[int]] = field(default_factory=list)
    # Bumped by the block manager on every change to the tables other than an append (a copied
    # or released entry, a trim, a free), so the runner's persistent rows (input_batch.py) copy
    # only the appended blocks otherwise.
    table_version: int = 0
    num_released: int = 0  # null entries behind a sliding window, over all its tables
    fork_children: list["Sequence"] = field(default_factory=list)  # n > 1: siblings to fork
    grammar: Any = None  # structured output: this stream's llguidance matcher
    spec_tokens: list[int] = field(default_factory=list)  # proposals to verify this step
    spec: Any = None  # speculative decoding's per-sequence state (SeqSpecState)
    # prompt_logprobs: the prompt's entries so far ([None] for its first token), filled by the
    # engine from the logits its prefill chunks keep; None when the request did not ask.
    prompt_scores: list | None = None
    # What each scored position keeps in prompt_scores: "entries" (prompt_logprobs' dicts), or, for
    # the engine's own scoring requests (engine/scoring.py), "logits" (the position's whole logits
    # row, the prompt's last position included, so with no None first), "logprob" (the next
    # token's logprob) or "logprob_top1" ((logprob, argmax) pairs); "pool" for a pooling request.
    score_kind: str = "entries"
    max_chunk: int | None = None  # at most this many tokens a step (a scoring request's chunk_size)
    # A pooling request (an embedding, engine/pooling.py): its PoolingConfig, what its prefill's
    # final hidden states add up to so far, and the prompt positions pooled (a recompute after
    # preemption skips them).
    pooling: Any = None
    pooled: Any = None
    num_pooled: int = 0
    lora: Any = None  # the request's LoRARequest (pagedllm/lora), None for the base model
    mm: Any = None  # a prompt with images: its MultiModalInput (pagedllm/multimodal), else None

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def lora_id(self) -> int:
        """The adapter's lora_int_id, 0 for the base model."""
        return 0 if self.lora is None else self.lora.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def scoring_prompt(self) -> bool:
        """Its prompt's logprobs are still being computed, chunk by chunk, by its prefill."""
        return self.prompt_scores is not None and len(self.prompt_scores) < len(self.prompt_token_ids)

    @property
    def score_end(self) -> int:
        """Scoring computes the logits of prompt positions [0, score_end): every one for "logits",
        else all but the last, which predicts nothing of the prompt."""
        return self.num_prompt_tokens - (self.score_kind != "logits")

    @property
    def num_scored(self) -> int:
        """Prompt positions scored so far (their entries, less the first token's None)."""
        return len(self.prompt_scores) - (self.score_kind != "logits")

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position's output is wanted (prompt scoring, pooling): no prefix match."""
        return self.scoring_prompt or (self.pooling is not None and self.num_pooled < self.num_prompt_tokens)

    @property
    def scoring_only(self) -> bool:
        """max_tokens=0: the prompt is scored and nothing is generated."""
        return self.params.max_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def truncate_output(self, keep: int) -> int:
        """Keep the first `keep` output tokens (a stop string ended the stream there); returns
        how many went."""
        drop = self.num_output_tokens - keep
        if drop > 0:
            del self.output_token_ids[keep:]
            del self.token_ids[len(self.token_ids) - drop :]
        return max(drop, 0)
