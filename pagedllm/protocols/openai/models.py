"""OpenAI-compatible request and response models (with mistral.rs's usage fields).

The same models serve the HTTP server and the mistral.rs-style Python API, so a
`ChatCompletionRequest` built in Python validates exactly like a JSON body.
Numbers are checked strictly (no booleans, strings or NaN where a number is
expected) because a lax coercion would turn a client bug into odd sampling.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    WithJsonSchema,
    model_serializer,
    model_validator,
)

from ...sampling.params import check_limits

# -- strict scalar types -------------------------------------------------------


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("must be a number")
    if not math.isfinite(v):
        raise ValueError("must be a finite number")
    return float(v)


def _integer(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
            return int(v)  # JSON has one number type; 2.0 is an integer there
        raise ValueError("must be an integer")
    return v


Num = Annotated[float, PlainValidator(_number), WithJsonSchema({"type": "number"})]
Int = Annotated[int, PlainValidator(_integer), WithJsonSchema({"type": "integer"})]
SEED_LIMIT = 2**62  # torch generators take 64-bit seeds and the engine adds the choice index


class _Model(BaseModel):
    # Unknown fields are accepted and ignored (clients send vendor extensions); wrong types
    # of known fields are errors.
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class _SamplingFields(_Model):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: Int | None = Field(default=None, ge=1, le=2**31)
    # Ranges are checked by SamplingParams' one copy of the limits (see _check_limits).
    temperature: Num | None = None
    top_p: Num | None = None
    top_k: Int | None = None
    min_p: Num | None = None
    presence_penalty: Num | None = None
    frequency_penalty: Num | None = None
    repetition_penalty: Num | None = None
    n: Int = Field(default=1, validation_alias=AliasChoices("n", "n_choices"))
    seed: Int | None = Field(default=None, ge=-SEED_LIMIT, le=SEED_LIMIT)
    stop: str | list[str] | None = Field(default=None, validation_alias=AliasChoices("stop", "stop_seqs"))
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, Num] | None = None
    # Structured output: OpenAI's field, and vLLM's (`guided_*` are read from the extra fields).
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None

    @model_validator(mode="after")
    def _check_limits(self):
        check_limits(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            n=self.n,
        )
        lp = getattr(self, "top_logprobs", None) if isinstance(self, ChatCompletionRequest) else self.logprobs
        check_limits(logprobs=lp)
        return self


class TextPart(_Model):
    """A content part: {"type": "text", "text": ...} or {"type": "image_url", "image_url": {"url": ...}}."""

    type: str
    text: str | None = None
    image_url: dict | str | None = None


class ChatMessage(_Model):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: which call it answers


class ResponseFormat(_Model):
    type: str = "text"
    json_schema: dict | None = None  # {"name", "schema", "strict"} for type "json_schema"


class ChatCompletionRequest(_SamplingFields):
    """An OpenAI chat completion request; `n_choices` and `stop_seqs` are mistral.rs's names."""

    messages: list[ChatMessage]
    max_completion_tokens: Int | None = Field(default=None, ge=1, le=2**31)
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: extra variables for the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict | None = None


class CompletionRequest(_SamplingFields):
    """An OpenAI (legacy) text completion request."""

    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = Field(default=None, ge=0, le=2**31)  # 0: echo the scored prompt only
    logprobs: Int | None = None
    echo: bool = False
    best_of: Int | None = Field(default=None, ge=1)
    suffix: str | None = None


# -- responses -----------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    """OpenAI's token counts plus mistral.rs's speed and timing figures."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    avg_tok_per_sec: float = 0.0
    avg_prompt_tok_per_sec: float = 0.0
    avg_compl_tok_per_sec: float = 0.0
    total_time_sec: float = 0.0
    total_prompt_time_sec: float = 0.0
    total_completion_time_sec: float = 0.0


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    # vLLM's: the reasoning a reasoning model wrote before its answer; absent for other models
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    # [{"id", "type": "function", "function": {"name", "arguments"}}]; absent without calls
    tool_calls: list[dict] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token id that ended the choice; null otherwise (EOS too)
    stop_reason: int | str | None = None


def _now() -> int:
    return int(time.time())


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class Delta(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    # [{"index", "id", "type", "function": {"name", "arguments"}}], as OpenAI streams them
    tool_calls: list[dict] | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> dict:
        # OpenAI leaves out what a delta does not carry ({} on the finish chunk), never null.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    # None for the first echoed prompt token, which nothing predicts.
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """Both the whole response and, when streaming, each chunk (OpenAI uses one shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagedllm"
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter's folder
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
