"""OpenAI's streamed chunks: chat and text-completion streamers over successive engine outputs,
and their server-sent event lines."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ...outputs import RequestOutput
from ...structured import tool_parser, tools as tool_api
from ..common import chat as neutral
from ..common.call import SSE_KEEPALIVE
from ..common.tokens import TokenText
from .logprobs import chat_logprobs, completion_logprobs, join_logprobs, prompt_logprobs, usage_from
from .models import (
    ChatCompletionChunk,
    ChunkChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Delta,
    ErrorInfo,
    ErrorResponse,
    Usage,
)

SYSTEM_FINGERPRINT = "pagedllm"


def finish_reason(reason: str | None, plan: tool_api.ToolPlan | None, called: bool) -> str | None:
    # "tool_calls" whenever the answer ended on its calls, forced ones included.
    if called and reason == "stop" and plan is not None:
        return "tool_calls"
    return reason


def sse_line(chunk: Any, include_usage: bool) -> str:
    """One chunk as a server-sent event; without stream_options.include_usage the chunks carry
    no `usage` key at all."""
    data = chunk.model_dump_json(exclude=None if include_usage else {"usage"})
    return f"data: {data}\n\n"


def with_running_usage(update: Any) -> Any:
    """A streamer's `events` whose chunks each carry the usage so far (vLLM's
    stream_options.continuous_usage_stats), from its `update`."""

    def events(out: RequestOutput, include_usage: bool) -> list[str]:
        done = sum(len(c.token_ids) for c in out.outputs)
        usage = Usage(
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=done,
            total_tokens=len(out.prompt_token_ids) + done,
        )
        chunks = update(out)
        for chunk in chunks:
            chunk.usage = usage
        return [sse_line(chunk, True) for chunk in chunks]

    return events


DONE = "data: [DONE]\n\n"


def sse_error(exc: Exception) -> str:
    body = ErrorResponse(error=ErrorInfo(message=str(exc), type="server_error"))
    return f"data: {body.model_dump_json()}\n\n"


@dataclass
class OpenAIFraming:
    """OpenAI's event stream (chat and text completions): the streamer's chunks as server-sent
    events, a usage chunk when the client asked for one, and [DONE] after everything, an error
    too."""

    streamer: Any  # ChatStreamer | CompletionStreamer
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats
    media_type: str = "text/event-stream"

    def __post_init__(self) -> None:
        self._events = with_running_usage(self.streamer.update) if self.continuous_usage else self.streamer.events

    def start(self) -> list[str]:
        return [sse_line(c, self.include_usage) for c in self.streamer.start()]

    def events(self, out: RequestOutput) -> list[str]:
        return self._events(out, self.include_usage)

    def end(self, finals: list[RequestOutput]) -> list[str]:
        usage = [sse_line(self.streamer.usage_chunk(finals), True)] if self.include_usage else []
        return [*usage, DONE]

    def error(self, exc: Exception) -> list[str]:
        return [sse_error(exc), DONE]

    def keepalive(self) -> list[str]:
        """A chat stream's empty delta (clients that time out on idle chunks, qwen-code's 240 s
        for one, count it; every client reads it as nothing); a comment for text completions,
        whose clients read each chunk's choices[0]."""
        if isinstance(self.streamer, ChatStreamer):
            return [sse_line(self.streamer._chunk([ChunkChoice(index=0, delta=Delta())]), self.include_usage)]
        return [SSE_KEEPALIVE]


_SLOT = "PAGEDLLM_TEXT_SLOT"


class TextChunkTemplate:
    """The server-sent event of the commonest chunk, one choice's plain text delta (no logprobs,
    tool calls or finish), cut from the chunk model's own JSON around a placeholder text, so a
    token costs one json.dumps of its text instead of building and serializing the pydantic
    chunk (about 10x less work on the event loop, which shares the GIL and the cores with the
    engine thread). The placeholder's chunk fixes `created`, as OpenAI keeps it for a stream."""

    def __init__(self, chunk: Any, include_usage: bool) -> None:
        head, sep, tail = sse_line(chunk, include_usage).partition(json.dumps(_SLOT))
        if not sep or _SLOT in tail:
            raise ValueError("the chunk must hold the placeholder text exactly once")
        self.head, self.tail = head, tail

    def line(self, text: str) -> str:
        # pydantic writes strings as json.dumps(ensure_ascii=False) does (tests/test_server.py)
        return self.head + json.dumps(text, ensure_ascii=False) + self.tail


@dataclass
class _ChoiceState:
    sent_logprobs: int = 0
    text_len: int = 0  # characters sent so far (for completion logprobs' text_offset)
    echoed: bool = False
    done: bool = False


@dataclass
class ChatStreamer:
    """Builds the chunks of one streamed chat completion from successive engine outputs."""

    rid: str
    model: str
    n: int
    tt: TokenText | None = None  # set when logprobs were asked for
    tools: tool_api.ToolPlan | None = None  # set when the answer may hold tool calls
    reasoning: neutral.Reasoning | None = None  # set when the model writes reasoning first
    states: list[_ChoiceState] = field(default_factory=list)
    parsers: list[tool_parser.StreamParser] = field(default_factory=list)
    splitters: list[Any] = field(default_factory=list)
    templates: dict[tuple[int, bool], TextChunkTemplate] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.states = [_ChoiceState() for _ in range(self.n)]
        parsers = [neutral.answer_stream_parser(self.tools) for _ in range(self.n)]
        self.parsers = [p for p in parsers if p is not None]  # (all or none)
        self.splitters = [self.reasoning.splitter() for _ in range(self.n)] if self.reasoning else []

    def _chunk(self, choices: list[ChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.rid, model=self.model, choices=choices, usage=usage, system_fingerprint=SYSTEM_FINGERPRINT
        )

    def start(self) -> list[ChatCompletionChunk]:
        return [self._chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))]) for i in range(self.n)]

    def update(self, out: RequestOutput) -> list[ChatCompletionChunk]:
        chunks = []
        for c in out.outputs:
            st = self.states[c.index]
            if st.done:
                continue
            lp = None
            if self.tt is not None and c.logprobs and len(c.logprobs) > st.sent_logprobs:
                lp = chat_logprobs(c.logprobs[st.sent_logprobs :], self.tt)
                st.sent_logprobs = len(c.logprobs)
            text, calls, reason, thought = c.delta_text, [], c.finish_reason, ""
            if self.splitters:  # the reasoning first; the rest is the answer
                thought, text = self.splitters[c.index].feed(text)
                if c.finish_reason is not None:
                    more_thought, more_text = self.splitters[c.index].finish()
                    thought, text = thought + more_thought, text + more_text
            if self.parsers:
                parser = self.parsers[c.index]
                text, calls = parser.feed(text)
                if c.finish_reason is not None:
                    more_text, more_calls = parser.finish()
                    text, calls = text + more_text, calls + more_calls
                if self.tools.forced and parser.calls:
                    text = ""
                reason = finish_reason(c.finish_reason, self.tools, parser.calls > 0)
            if not text and not thought and not calls and lp is None and reason is None:
                continue
            st.done = reason is not None
            if thought:  # its own delta, as vLLM streams reasoning_content
                chunks.append(self._chunk([ChunkChoice(index=c.index, delta=Delta(reasoning_content=thought))]))
            # The calls' deltas first, one chunk each, as OpenAI sends them; then the text.
            chunks += [self._chunk([ChunkChoice(index=c.index, delta=Delta(tool_calls=[d]))]) for d in calls]
            if text or lp is not None:
                chunks.append(self._chunk([ChunkChoice(index=c.index, delta=Delta(content=text or None), logprobs=lp)]))
            if reason is not None:  # its own chunk with an empty delta, as OpenAI ends a choice
                chunks.append(
                    self._chunk(
                        [ChunkChoice(index=c.index, delta=Delta(), finish_reason=reason, stop_reason=c.stop_reason)]
                    )
                )
        return chunks

    def usage_chunk(self, finals: list[RequestOutput]) -> ChatCompletionChunk:
        return self._chunk([], usage_from(finals))

    def events(self, out: RequestOutput, include_usage: bool) -> list[str]:
        """`update(out)` as server-sent events; a plain text delta takes its template."""
        c = out.outputs[0] if len(out.outputs) == 1 else None
        if (
            c is None
            or self.tt is not None
            or self.parsers
            or self.splitters
            or c.finish_reason is not None
            or not c.delta_text
            or self.states[c.index].done
        ):
            return [sse_line(chunk, include_usage) for chunk in self.update(out)]
        key = (c.index, include_usage)
        tpl = self.templates.get(key)
        if tpl is None:
            tpl = self.templates[key] = TextChunkTemplate(
                self._chunk([ChunkChoice(index=c.index, delta=Delta(content=_SLOT))]), include_usage
            )
        return [tpl.line(c.delta_text)]


@dataclass
class CompletionStreamer:
    """Builds the chunks of one streamed text completion (one or more prompts, n each)."""

    rid: str
    model: str
    n: int
    prompt_index: dict[str, int]  # engine request id -> prompt position
    tt: TokenText | None = None
    echo: list[str] | None = None
    states: dict[int, _ChoiceState] = field(default_factory=dict)
    templates: dict[tuple[int, bool], TextChunkTemplate] = field(default_factory=dict)

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(
            id=self.rid, model=self.model, choices=choices, usage=usage, system_fingerprint=SYSTEM_FINGERPRINT
        )

    def start(self) -> list[CompletionResponse]:
        return []  # text completions have no opening chunk

    def update(self, out: RequestOutput) -> list[CompletionResponse]:
        p = self.prompt_index[out.request_id]
        chunks = []
        for c in out.outputs:
            idx = p * self.n + c.index
            st = self.states.setdefault(idx, _ChoiceState())
            if st.done:
                continue
            prefix, echoed_lp = "", None
            if self.echo and not st.echoed:
                prefix, st.echoed = self.echo[p], True
                if self.tt is not None and out.prompt_logprobs is not None:
                    echoed_lp = prompt_logprobs(out, self.tt, len(prefix))
            text = prefix + c.delta_text
            lp = None
            if self.tt is not None and c.logprobs and len(c.logprobs) > st.sent_logprobs:
                lp = completion_logprobs(c.logprobs[st.sent_logprobs :], self.tt, st.text_len + len(prefix))
                st.sent_logprobs = len(c.logprobs)
            if echoed_lp is not None:
                lp = join_logprobs(echoed_lp, lp or CompletionLogprobs())
            if not text and lp is None and c.finish_reason is None:
                continue
            st.text_len += len(text)
            st.done = c.finish_reason is not None
            chunks.append(
                self._chunk(
                    [
                        CompletionChoice(
                            index=idx, text=text, logprobs=lp, finish_reason=c.finish_reason, stop_reason=c.stop_reason
                        )
                    ]
                )
            )
        return chunks

    def usage_chunk(self, finals: list[RequestOutput]) -> CompletionResponse:
        return self._chunk([], usage_from(finals))

    def events(self, out: RequestOutput, include_usage: bool) -> list[str]:
        """`update(out)` as server-sent events; a plain text delta takes its template."""
        c = out.outputs[0] if len(out.outputs) == 1 else None
        idx = self.prompt_index[out.request_id] * self.n + c.index if c is not None else -1
        st = self.states.get(idx)
        if (
            c is None
            or self.tt is not None
            or st is None
            or st.done
            or (self.echo and not st.echoed)
            or c.finish_reason is not None
            or not c.delta_text
        ):
            return [sse_line(chunk, include_usage) for chunk in self.update(out)]
        st.text_len += len(c.delta_text)
        key = (idx, include_usage)
        tpl = self.templates.get(key)
        if tpl is None:
            tpl = self.templates[key] = TextChunkTemplate(
                self._chunk([CompletionChoice(index=idx, text=_SLOT)]), include_usage
            )
        return [tpl.line(c.delta_text)]
