"""Per-request sampling settings, named as in vLLM so user code ports over."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..structured.params import StructuredOutputs

MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """A sampling setting out of range; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"invalid SamplingParams: {message}")
        self.param, self.message = param, message


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# name -> (accepts, what it must be). The one copy of the limits: SamplingParams and the
# server's request models both check through `check_limits`.
_LIMITS = {
    "n": (lambda x: _is_int(x) and x >= 1, "an integer >= 1"),
    "max_tokens": (lambda x: _is_int(x) and x >= 1, "an integer >= 1 (0 only with prompt_logprobs: scoring)"),
    "temperature": (lambda x: x >= 0, ">= 0 (0 means greedy)"),
    "top_p": (lambda x: 0 < x <= 1, "in (0, 1]"),
    "top_k": (lambda x: _is_int(x) and x >= -1, "-1 (off) or a positive integer"),
    "min_p": (lambda x: 0 <= x <= 1, "in [0, 1]"),
    "presence_penalty": (lambda x: -2 <= x <= 2, "in [-2, 2]"),
    "frequency_penalty": (lambda x: -2 <= x <= 2, "in [-2, 2]"),
    "repetition_penalty": (lambda x: x > 0, "> 0"),
    "logprobs": (lambda x: _is_int(x) and 0 <= x <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
    "prompt_logprobs": (lambda x: _is_int(x) and 0 <= x <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
}


def check_limits(**values) -> None:
    """Raise SamplingParamsError for the first given setting out of range (None: not given)."""
    for name, x in values.items():
        if x is None:
            continue
        accepts, must = _LIMITS[name]
        if isinstance(x, float) and not math.isfinite(x):
            raise SamplingParamsError(name, f"{name} must be a finite number, got {x}")
        if not accepts(x):
            raise SamplingParamsError(name, f"{name} must be {must}, got {x!r}")


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
    # token id -> a value in [-100, 100] added to its logit before sampling (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = _check_logit_bias(self.logit_bias)
        self.validate()
        try:
            self.structured = StructuredOutputs.coerce(self.structured)
        except (TypeError, ValueError) as e:
            raise SamplingParamsError("structured", str(e)) from None

    def validate(self) -> None:
        # max_tokens=0 scores the prompt only (echo + logprobs), so it needs prompt_logprobs.
        scoring_only = _is_int(self.max_tokens) and self.max_tokens == 0 and self.prompt_logprobs is not None
        check_limits(
            n=self.n,
            max_tokens=None if scoring_only else self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop", "stop strings must be non-empty")

    @property
    def has_logit_bias(self) -> bool:
        return bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def argmax_only(self) -> bool:
        """Its token is its logits row's argmax and nothing else is read from the row (the
        sampler's fast path, where the step's mask, if any, leaves it alone too)."""
        return self.greedy and self.logprobs is None and not self.needs_penalties and not self.has_logit_bias

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _check_logit_bias(bias: dict | None) -> dict[int, float] | None:
    """{token id: bias} with ids as ints (JSON sends them as strings) and biases in [-100, 100]."""
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise SamplingParamsError("logit_bias", "logit_bias must map token ids to numbers")
    out = {}
    for k, v in bias.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            tid = -1
        if isinstance(k, bool) or tid < 0 or isinstance(k, float):
            raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not -100 <= v <= 100:
            raise SamplingParamsError(
                "logit_bias", f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {k}"
            )
        out[tid] = float(v)
    return out
