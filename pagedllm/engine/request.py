"""A request as the engine holds it: its prompt, its sequences (n of them), and the output
processor's per-sequence state beside them."""

from __future__ import annotations

from dataclasses import dataclass, field
import torch

from ..outputs import RequestMetrics
from ..sampling.params import SamplingParams
from .sequence import Sequence


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    states: list = field(default_factory=list)  # the output processor's SeqOutputState per sequence
    error: str | None = None  # why the request failed (finish_reason "error")
    prompt_logprobs: list[dict[int, float] | None] | None = None
    embedding: torch.Tensor | None = None  # a pooling request's vector, once its prompt is pooled

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
