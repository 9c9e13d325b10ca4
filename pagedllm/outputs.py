"""What callers get back: vLLM-shaped request outputs with timing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


class CompletionOutput:
    """One completion as of one step. `text`, `token_ids` and `logprobs` may be given as
    zero-argument callables: a running stream hands out a snapshot that is built only when read,
    so a step costs O(new tokens) whatever the length so far (streaming reads the deltas)."""

    def __init__(
        self,
        index: int,
        text: str | Callable[[], str],
        token_ids: list[int] | Callable[[], list[int]],
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
        logprobs: list[dict] | Callable[[], list[dict] | None] | None = None,
        delta_text: str = "",
        delta_token_ids: list[int] | None = None,
    ) -> None:
        self.index = index
        self._text = text
        self._token_ids = token_ids
        self.finish_reason = finish_reason  # "stop" | "length" | "abort" | "error" | None while running
        self.stop_reason = stop_reason  # the stop string or token that ended it
        self._logprobs = logprobs
        self.delta_text = delta_text  # text added since the previous step (streaming)
        self.delta_token_ids = delta_token_ids if delta_token_ids is not None else []

    @property
    def text(self) -> str:
        if callable(self._text):
            self._text = self._text()
        return self._text

    @property
    def token_ids(self) -> list[int]:
        if callable(self._token_ids):
            self._token_ids = self._token_ids()
        return self._token_ids

    @property
    def logprobs(self) -> list[dict] | None:
        if callable(self._logprobs):
            self._logprobs = self._logprobs()
        return self._logprobs

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None  # its prompt's first chunk was scheduled
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Arrival to the first scheduled step: the time it waited behind other requests."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        dt = self.finished_time - self.first_token_time
        return (self.num_output_tokens - 1) / dt if dt > 0 else None

    @property
    def total_time(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None  # set when the request failed (finish_reason "error")
    # SamplingParams(prompt_logprobs=k), as in vLLM: one entry per prompt token, None for the
    # first; each maps the prompt token and the k most likely tokens at that place to logprobs.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # An embedding request's vector (a float32 CPU tensor), once it is finished.
    embedding: Any = None

    # Shortcuts to the first completion, for the common n=1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class RequestFailedError(RuntimeError):
    """A request failed while generating (its logits were not finite). `outputs` holds every
    output of the call, the failed ones (finish_reason "error") and the others, complete."""

    def __init__(self, message: str, outputs: list[RequestOutput] | None = None) -> None:
        super().__init__(message)
        self.outputs = outputs or []


def raise_failed(outputs: list[RequestOutput]) -> None:
    """Raise `RequestFailedError` naming the first failed request of `outputs`, if any."""
    failed = [o for o in outputs if o.error]
    if failed:
        more = f" ({len(failed) - 1} more of the {len(outputs)} requests failed too)" if len(failed) > 1 else ""
        raise RequestFailedError(failed[0].error + more, outputs)
