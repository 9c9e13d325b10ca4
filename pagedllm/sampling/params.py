"""Per-request sampling settings, named as in vLLM so user code ports over."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..structured.params import StructuredOutputs


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # number of top logprobs to return per token
    prompt_logprobs: int | None = None  # the same for every prompt token (vLLM); 0: the token's own
    # Constrain the output (JSON schema, regex, choice, grammar): a StructuredOutputs or a dict.
    structured: StructuredOutputs | dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()
        try:
            self.structured = StructuredOutputs.coerce(self.structured)
        except (TypeError, ValueError) as e:
            raise ValueError(f"invalid SamplingParams: {e}") from None

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"invalid SamplingParams: {msg}")

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            bad(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        # max_tokens=0 scores the prompt only (echo + logprobs), so it needs prompt_logprobs.
        least = 0 if self.prompt_logprobs is not None else 1
        if not isinstance(self.max_tokens, int) or self.max_tokens < least:
            bad(f"max_tokens must be an integer >= {least}, got {self.max_tokens!r}"
                + (" (0 is allowed with prompt_logprobs)" if self.max_tokens == 0 else ""))
        if self.temperature < 0:
            bad(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not (0 < self.top_p <= 1):
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not (0 <= self.min_p <= 1):
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not (-2 <= self.presence_penalty <= 2):
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not (-2 <= self.frequency_penalty <= 2):
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            bad(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            bad("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
