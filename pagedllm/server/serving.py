"""Turning OpenAI-style requests into engine inputs, and engine outputs into responses.

Shared by the HTTP server and the mistral.rs-style `Runner`: nothing here touches
the engine itself, so it is safe to call from any thread.
"""
from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import jinja2

from ..native import release_omp_threads
from ..outputs import RequestOutput
from ..sampling.params import SamplingParams, SamplingParamsError
from ..structured import openai as structured_api, tools as tool_api
from .protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChunkChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    PromptTokensDetails,
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
)

logger = logging.getLogger(__name__)

SYSTEM_FINGERPRINT = "pagedllm"
MAX_STOP_STRINGS = 16
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}


class ApiError(Exception):
    """A request the server refuses; rendered as OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code


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

    @classmethod
    def from_llm(cls, llm: Any, model_name: str | None = None, max_n: int | None = None) -> "ServingContext":
        eng = llm.engine
        return cls(tokenizer=llm.tokenizer, model_name=model_name or llm.model_name,
                   max_model_len=eng.sched_config.max_model_len,
                   block_size=eng.cache_config.block_size,
                   usable_blocks=eng.block_manager.num_usable_blocks,
                   max_n=max_n or min(128, eng.sched_config.max_num_seqs),
                   vocab_size=eng.model_config.vocab_size,
                   processor=getattr(llm, "processor", None), media_policy=getattr(llm, "media_policy", None))

    def default_max_tokens(self, prompt_len: int, n: int) -> int:
        """Without max_tokens a request may run to the context end, as far as the cache can hold
        n copies of it (a larger default would be refused as never fitting)."""
        room = min(self.max_model_len, self.usable_blocks * self.block_size // max(n, 1))
        return max(1, room - prompt_len)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# -- request preparation ---------------------------------------------------------


def _common_checks(req: ChatCompletionRequest | CompletionRequest, ctx: ServingContext, count: int) -> None:
    if req.n * count > ctx.max_n:
        what = f"n={req.n}" if count == 1 else f"n={req.n} x {count} prompts"
        raise ApiError(f"{what} asks for {req.n * count} completions; this server allows at most "
                       f"{ctx.max_n} per request", param="n")
    for k in req.logit_bias or {}:
        tid = int(k) if k.strip().lstrip("-").isdigit() else None
        if tid is None or tid < 0 or (ctx.vocab_size is not None and tid >= ctx.vocab_size):
            where = f"[0, {ctx.vocab_size})" if ctx.vocab_size else "the vocabulary"
            raise ApiError(f"logit_bias key {k!r} is not a token id in {where}; keys are token ids "
                           "as strings, e.g. {\"50256\": -100}", param="logit_bias")
    if req.stream_options is not None and not req.stream:
        raise ApiError("stream_options is only allowed when stream is true", param="stream_options")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}",
                       param="stop")
    if any(not s for s in stops):
        raise ApiError("stop strings must be non-empty", param="stop")


def structured_outputs(req: ChatCompletionRequest | CompletionRequest):
    rf = req.response_format.model_dump() if req.response_format is not None else None
    extra = dict(req.model_extra or {})
    extra["structured_outputs"] = req.structured_outputs
    try:
        return structured_api.from_request(rf, extra)
    except structured_api.StructuredRequestError as e:
        raise ApiError(str(e), param=e.param) from None


def check_context(ctx: ServingContext, prompt_len: int, max_tokens: int | None, where: str) -> None:
    """OpenAI's refusal (and message) for a prompt plus max_tokens past the context."""
    if max_tokens is not None and prompt_len + max_tokens > ctx.max_model_len:
        raise ApiError(f"This model's maximum context length is {ctx.max_model_len} tokens. However, "
                       f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the {where}, "
                       f"{max_tokens} in the completion). Please reduce the length of the {where} "
                       "or completion.", param="max_tokens", code="context_length_exceeded")


def sampling_params(req: ChatCompletionRequest | CompletionRequest, ctx: ServingContext,
                    prompt_len: int, max_tokens: int | None, default_max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    if max_tokens is None:
        max_tokens = default_max_tokens or ctx.default_max_tokens(prompt_len, req.n)
    structured = structured_outputs(req)
    top_k = req.top_k if req.top_k is not None else -1
    try:
        return SamplingParams(
            n=req.n, max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=-1 if top_k == 0 else top_k,
            top_p=1.0 if req.top_p is None else req.top_p,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed, stop=req.stop, stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos, logprobs=logprobs, structured=structured,
            prompt_logprobs=prompt_logprobs, logit_bias=req.logit_bias)
    except SamplingParamsError as e:
        raise ApiError(e.message, param=e.param) from None


def _message_text(msg: Any, i: int, ctx: ServingContext | None = None) -> str | list[dict]:
    """The message's text; with image parts (a vision-language model), its parts as dicts."""
    content = msg.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    images = False
    for j, part in enumerate(content):
        if part.type == "image_url":
            if ctx is None:
                raise ApiError("image_url parts are taken on /v1/chat/completions only",
                               param=f"messages.{i}.content.{j}")
            if ctx.processor is None:
                raise ApiError(f"model {ctx.model_name!r} is text-only: it takes no images (image_url "
                               "parts); send text, or serve a vision-language model",
                               param=f"messages.{i}.content.{j}")
            images = True
            continue
        if part.type != "text" or part.text is None:
            raise ApiError(f"content part type {part.type!r} is not supported: use text or image_url parts",
                           param=f"messages.{i}.content.{j}")
    if images:
        return [p.model_dump(exclude_none=True) for p in content]
    for part in content:
        parts.append(part.text)
    return "".join(parts)


def tool_plan(req: ChatCompletionRequest, ctx: ServingContext) -> tool_api.ToolPlan | None:
    try:
        tags = tool_api.tag_token_ids(ctx.tokenizer) if req.tools and hasattr(ctx.tokenizer, "backend") else {}
        return tool_api.plan(req.tools, req.tool_choice, req.parallel_tool_calls,
                             getattr(ctx.tokenizer, "chat_template", None), tags)
    except structured_api.StructuredRequestError as e:
        raise ApiError(str(e), param=e.param) from None


def chat_prompt(req: ChatCompletionRequest, ctx: ServingContext,
                plan: tool_api.ToolPlan | None = None) -> list[int] | Any:
    """The prompt's token ids; a MultiModalInput (pagedllm/multimodal) when images are in it,
    made by the model's processor (its chat template and image processing)."""
    if not req.messages:
        raise ApiError("messages must hold at least one message", param="messages")
    messages = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise ApiError(f"unknown role {m.role!r}; use one of {sorted(CHAT_ROLES)}",
                           param=f"messages.{i}.role")
        msg = {"role": "system" if m.role == "developer" else m.role, "content": _message_text(m, i, ctx)}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.role == "tool":
            if not m.tool_call_id:
                raise ApiError("a tool message needs tool_call_id (the id of the call it answers)",
                               param=f"messages.{i}.tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    if ctx.processor is not None and any(isinstance(m["content"], list) for m in messages):
        if plan is not None:
            raise ApiError("tools with images are not supported yet", param="tools")
        try:
            return ctx.processor.chat(messages, policy=ctx.media_policy)
        except (ValueError, jinja2.TemplateError) as e:
            raise ApiError(f"cannot use the messages' images: {e}", param="messages") from None
        finally:  # the image work ran on this request-preparation thread, not the engine's
            release_omp_threads()
    template = getattr(ctx.tokenizer, "chat_template", None)
    messages = tool_api.template_messages(messages, plan, template)
    extra = {"tools": plan.tools} if plan is not None else {}
    try:
        return ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 **extra)
    except (ValueError, jinja2.TemplateError) as e:
        raise ApiError(f"cannot format the messages with the model's chat template: {e}",
                       param="messages") from None


def prepare_chat(req: ChatCompletionRequest, ctx: ServingContext) -> tuple[list[int], SamplingParams]:
    ids, params, _ = _prepare_chat(req, ctx)
    return ids, params


def _prepare_chat(req: ChatCompletionRequest, ctx: ServingContext
                  ) -> tuple[list[int], SamplingParams, tool_api.ToolPlan | None]:
    _common_checks(req, ctx, 1)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError("top_logprobs needs logprobs to be true", param="top_logprobs")
    plan = tool_plan(req, ctx)
    ids = chat_prompt(req, ctx, plan)
    n_ids = len(ids) if isinstance(ids, list) else len(ids.prompt_token_ids)
    max_tokens = req.max_completion_tokens or req.max_tokens
    check_context(ctx, n_ids, max_tokens, "messages")
    lp = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, ctx, n_ids, max_tokens, None, lp)
    forced = plan.grammar() if plan is not None else None
    if forced is not None:
        # The forced call is constrained by the tool; response_format governs text answers,
        # which a forced call does not give (vLLM's reading too).
        params.structured = forced
    return ids, params, plan


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise ApiError("prompt is empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    return list(p)


def prepare_completion(req: CompletionRequest, ctx: ServingContext
                       ) -> tuple[list[str | list[int]], list[SamplingParams]]:
    prompts = completion_prompts(req)
    _common_checks(req, ctx, len(prompts))
    if req.suffix:
        raise ApiError("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError("best_of is not supported (other than best_of == n)", param="best_of")
    if req.max_tokens == 0 and not req.echo:
        raise ApiError("max_tokens 0 only makes sense with echo (to score the prompt)", param="max_tokens")
    if any(isinstance(p, str) and not p for p in prompts):
        raise ApiError("prompt is empty: give at least one character or token id", param="prompt")
    if req.max_tokens is not None:
        for p in prompts:
            n = len(p) if isinstance(p, list) else len(ctx.tokenizer.encode(p))
            check_context(ctx, n, req.max_tokens, "prompt")
    # OpenAI's default of 16 tokens for text completions, so the prompt length is not needed.
    # Echo with logprobs scores the prompt too (how evaluation harnesses get loglikelihoods).
    scored = req.echo and (req.logprobs is not None or req.max_tokens == 0)
    params = [sampling_params(req, ctx, 0, req.max_tokens, 16, req.logprobs,
                              prompt_logprobs=(req.logprobs or 0) if scored else None) for _ in prompts]
    return prompts, params


# -- logprobs ------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


class TokenText:
    """The exact bytes and a printable string of single tokens, cached."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        backend = getattr(tokenizer, "backend", None)
        self._byte_level = "ByteLevel" in repr(getattr(backend, "decoder", None))
        self._special = getattr(tokenizer, "special_token_ids", set())
        self._cache: dict[int, bytes] = {}

    def bytes(self, tid: int) -> bytes:
        b = self._cache.get(tid)
        if b is None:
            b = self._compute(tid)
            self._cache[tid] = b
        return b

    def _compute(self, tid: int) -> bytes:
        piece = self._tok.id_to_token(tid) if hasattr(self._tok, "id_to_token") else None
        if piece is not None and self._byte_level and tid not in self._special \
                and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return self._tok.decode([tid], skip_special_tokens=False).encode("utf-8")

    def text(self, tid: int) -> str:
        return self.bytes(tid).decode("utf-8", errors="replace")


def chat_logprobs(entries: list[dict], tt: TokenText) -> ChatLogprobs:
    content = []
    for e in entries:
        tid = e["token_id"]
        tops = [TopLogprob(token=tt.text(t), logprob=lp, bytes=list(tt.bytes(t))) for t, lp in e["top"]]
        content.append(TokenLogprob(token=tt.text(tid), logprob=e["logprob"],
                                    bytes=list(tt.bytes(tid)), top_logprobs=tops))
    return ChatLogprobs(content=content)


def echo_texts(prompts: list[str | list[int]], tokenizer: Any) -> list[str]:
    """The prompts as `echo` repeats them: a token-id prompt decoded with its special tokens,
    the same text its logprobs' `tokens` spell."""
    return [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False) for p in prompts]


def prompt_logprobs(out: RequestOutput, tt: TokenText, text_len: int | None = None) -> CompletionLogprobs:
    """The echoed prompt's tokens and logprobs (None for the first, as OpenAI sends them).
    Offsets never pass `text_len`, the echoed text's length, where the completion's start."""
    lp = CompletionLogprobs()
    offset = 0
    for tid, entry in zip(out.prompt_token_ids, out.prompt_logprobs or []):
        tok = tt.text(tid)
        lp.tokens.append(tok)
        lp.token_logprobs.append(None if entry is None else entry[tid])
        lp.top_logprobs.append(None if entry is None else {tt.text(t): v for t, v in entry.items()})
        lp.text_offset.append(offset if text_len is None else min(offset, text_len))
        offset += len(tok)
    return lp


def join_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs,
                              text_offset=a.text_offset + b.text_offset)


def completion_logprobs(entries: list[dict], tt: TokenText, offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for e in entries:
        tok = tt.text(e["token_id"])
        out.tokens.append(tok)
        out.token_logprobs.append(e["logprob"])
        # The sampled token is always among them, as OpenAI sends it (logprobs 0 included).
        out.top_logprobs.append({tok: e["logprob"], **{tt.text(t): lp for t, lp in e["top"]}})
        out.text_offset.append(offset)
        offset += len(tok)
    return out


# -- usage ---------------------------------------------------------------------------


def usage_from(finals: list[RequestOutput]) -> Usage:
    """Token counts and mistral.rs's timing figures over one or more finished requests."""
    prompt = sum(o.metrics.num_prompt_tokens for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals)
    arrival = min(o.metrics.arrival_time for o in finals)
    firsts = [o.metrics.first_token_time for o in finals if o.metrics.first_token_time is not None]
    ends = [o.metrics.finished_time for o in finals if o.metrics.finished_time is not None]
    end = max(ends) if ends else arrival
    first = max(firsts) if firsts else end
    total = max(0.0, end - arrival)
    prompt_time = max(0.0, first - arrival)
    compl_time = max(0.0, end - first)

    def rate(n: int, t: float) -> float:
        return n / t if t > 0 else 0.0

    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                 avg_tok_per_sec=rate(prompt + completion, total),
                 avg_prompt_tok_per_sec=rate(prompt, prompt_time),
                 avg_compl_tok_per_sec=rate(completion, compl_time),
                 total_time_sec=total, total_prompt_time_sec=prompt_time,
                 total_completion_time_sec=compl_time)


# -- whole responses -----------------------------------------------------------------


def _tool_call_dicts(calls: list[tool_api.ToolCall]) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def _finish_reason(reason: str | None, plan: tool_api.ToolPlan | None, called: bool) -> str | None:
    # "tool_calls" whenever the answer ended on its calls, forced ones included.
    if called and reason == "stop" and plan is not None:
        return "tool_calls"
    return reason


def chat_response(rid: str, model: str, final: RequestOutput, tt: TokenText | None,
                  tools: tool_api.ToolPlan | None = None) -> ChatCompletionResponse:
    choices = []
    for c in final.outputs:
        lp = chat_logprobs(c.logprobs or [], tt) if tt is not None else None
        content, calls = (tool_api.parse(c.text, tools.fmt) if tools is not None and tools.parses
                          else (c.text, []))
        if calls and tools.forced:
            content = None  # a forced answer holds nothing but its calls
        msg = ResponseMessage(content=content, tool_calls=_tool_call_dicts(calls) or None)
        choices.append(ChatChoice(index=c.index, message=msg, logprobs=lp,
                                  finish_reason=_finish_reason(c.finish_reason, tools, bool(calls)),
                                  stop_reason=c.stop_reason))
    return ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage_from([final]),
                                  system_fingerprint=SYSTEM_FINGERPRINT)


def completion_response(rid: str, model: str, finals: list[RequestOutput], n: int,
                        tt: TokenText | None, echo: list[str] | None) -> CompletionResponse:
    choices = []
    for p, out in enumerate(finals):
        prefix = echo[p] if echo else ""
        for c in out.outputs:
            lp = completion_logprobs(c.logprobs or [], tt, len(prefix)) if tt is not None else None
            if lp is not None and echo and out.prompt_logprobs is not None:
                lp = join_logprobs(prompt_logprobs(out, tt, len(prefix)), lp)
            choices.append(CompletionChoice(index=p * n + c.index, text=prefix + c.text,
                                            logprobs=lp, finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason))
    return CompletionResponse(id=rid, model=model, choices=choices, usage=usage_from(finals),
                              system_fingerprint=SYSTEM_FINGERPRINT)


# -- streaming -------------------------------------------------------------------------


def sse_line(chunk: Any, include_usage: bool) -> str:
    """One chunk as a server-sent event; without stream_options.include_usage the chunks carry
    no `usage` key at all."""
    data = chunk.model_dump_json(exclude=None if include_usage else {"usage"})
    return f"data: {data}\n\n"


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
    states: list[_ChoiceState] = field(default_factory=list)
    parsers: list[tool_api.StreamParser] = field(default_factory=list)
    templates: dict[tuple[int, bool], TextChunkTemplate] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.states = [_ChoiceState() for _ in range(self.n)]
        if self.tools is not None and self.tools.parses:
            self.parsers = [tool_api.StreamParser(self.tools.fmt) for _ in range(self.n)]

    def _chunk(self, choices: list[ChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.rid, model=self.model, choices=choices, usage=usage,
                                   system_fingerprint=SYSTEM_FINGERPRINT)

    def start(self) -> list[ChatCompletionChunk]:
        return [self._chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
                for i in range(self.n)]

    def update(self, out: RequestOutput) -> list[ChatCompletionChunk]:
        chunks = []
        for c in out.outputs:
            st = self.states[c.index]
            if st.done:
                continue
            lp = None
            if self.tt is not None and c.logprobs and len(c.logprobs) > st.sent_logprobs:
                lp = chat_logprobs(c.logprobs[st.sent_logprobs:], self.tt)
                st.sent_logprobs = len(c.logprobs)
            text, calls, reason = c.delta_text, [], c.finish_reason
            if self.parsers:
                parser = self.parsers[c.index]
                text, calls = parser.feed(c.delta_text)
                if c.finish_reason is not None:
                    more_text, more_calls = parser.finish()
                    text, calls = text + more_text, calls + more_calls
                if self.tools.forced and parser.calls:
                    text = ""
                reason = _finish_reason(c.finish_reason, self.tools, parser.calls > 0)
            if not text and not calls and lp is None and reason is None:
                continue
            st.done = reason is not None
            # The calls' deltas first, one chunk each, as OpenAI sends them; then the text.
            chunks += [self._chunk([ChunkChoice(index=c.index, delta=Delta(tool_calls=[d]))]) for d in calls]
            if text or lp is not None:
                chunks.append(self._chunk([ChunkChoice(index=c.index, delta=Delta(content=text or None),
                                                       logprobs=lp)]))
            if reason is not None:  # its own chunk with an empty delta, as OpenAI ends a choice
                chunks.append(self._chunk([ChunkChoice(index=c.index, delta=Delta(), finish_reason=reason,
                                                       stop_reason=c.stop_reason)]))
        return chunks

    def usage_chunk(self, finals: list[RequestOutput]) -> ChatCompletionChunk:
        return self._chunk([], usage_from(finals))

    def events(self, out: RequestOutput, include_usage: bool) -> list[str]:
        """`update(out)` as server-sent events; a plain text delta takes its template."""
        c = out.outputs[0] if len(out.outputs) == 1 else None
        if (c is None or self.tt is not None or self.parsers or c.finish_reason is not None
                or not c.delta_text or self.states[c.index].done):
            return [sse_line(chunk, include_usage) for chunk in self.update(out)]
        key = (c.index, include_usage)
        tpl = self.templates.get(key)
        if tpl is None:
            tpl = self.templates[key] = TextChunkTemplate(
                self._chunk([ChunkChoice(index=c.index, delta=Delta(content=_SLOT))]), include_usage)
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
        return CompletionResponse(id=self.rid, model=self.model, choices=choices, usage=usage,
                                  system_fingerprint=SYSTEM_FINGERPRINT)

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
                lp = completion_logprobs(c.logprobs[st.sent_logprobs:], self.tt, st.text_len + len(prefix))
                st.sent_logprobs = len(c.logprobs)
            if echoed_lp is not None:
                lp = join_logprobs(echoed_lp, lp or CompletionLogprobs())
            if not text and lp is None and c.finish_reason is None:
                continue
            st.text_len += len(text)
            st.done = c.finish_reason is not None
            chunks.append(self._chunk([CompletionChoice(index=idx, text=text, logprobs=lp,
                                                        finish_reason=c.finish_reason,
                                                        stop_reason=c.stop_reason)]))
        return chunks

    def usage_chunk(self, finals: list[RequestOutput]) -> CompletionResponse:
        return self._chunk([], usage_from(finals))

    def events(self, out: RequestOutput, include_usage: bool) -> list[str]:
        """`update(out)` as server-sent events; a plain text delta takes its template."""
        c = out.outputs[0] if len(out.outputs) == 1 else None
        idx = self.prompt_index[out.request_id] * self.n + c.index if c is not None else -1
        st = self.states.get(idx)
        if (c is None or self.tt is not None or st is None or st.done or (self.echo and not st.echoed)
                or c.finish_reason is not None or not c.delta_text):
            return [sse_line(chunk, include_usage) for chunk in self.update(out)]
        st.text_len += len(c.delta_text)
        key = (idx, include_usage)
        tpl = self.templates.get(key)
        if tpl is None:
            tpl = self.templates[key] = TextChunkTemplate(
                self._chunk([CompletionChoice(index=idx, text=_SLOT)]), include_usage)
        return [tpl.line(c.delta_text)]


# -- one request, start to answer ---------------------------------------------------------


@dataclass
class Call:
    """A chat or text-completion request made ready for the engine, and what turns its engine
    outputs into the OpenAI answer. The HTTP server and the `Runner` both answer through one, so
    tool calls, logprobs and usage come out the same from both; only the engine driving differs."""

    rid: str
    items: list[tuple[str, str | list[int], SamplingParams]]  # (engine request id, prompt, params)
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    grammar_param: str  # the request field blamed when the request's grammar does not compile
    streamer: ChatStreamer | CompletionStreamer
    respond: Any  # final outputs (in `items` order) -> the whole response

    @property
    def request_ids(self) -> list[str]:
        return [it[0] for it in self.items]  # (an item may carry a LoRARequest after its params)

    def response(self, finals: list[RequestOutput]) -> ChatCompletionResponse | CompletionResponse:
        return self.respond(finals)

    def usage_chunk(self) -> Any:
        """The streamer's usage chunk builder when the client asked for it, else None."""
        return self.streamer.usage_chunk if self.include_usage else None


def _include_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def chat_call(req: ChatCompletionRequest, ctx: ServingContext, token_text: TokenText) -> Call:
    """Validate and prepare a chat request (raises ApiError); its tool plan parses the answer."""
    ids, params, tools = _prepare_chat(req, ctx)
    rid = new_id("chatcmpl")
    tt = token_text if req.logprobs else None
    streamer = ChatStreamer(rid, ctx.model_name, req.n, tt, tools)
    grammar_param = "tools" if tools and tools.grammar() else "response_format"
    return Call(rid, [(rid, ids, params)], bool(req.stream), _include_usage(req), grammar_param, streamer,
                lambda finals: chat_response(rid, ctx.model_name, finals[0], tt, tools))


def completion_call(req: CompletionRequest, ctx: ServingContext, token_text: TokenText) -> Call:
    """Validate and prepare a text-completion request (raises ApiError): one engine request per
    prompt, each with n completions."""
    prompts, params = prepare_completion(req, ctx)
    rid = new_id("cmpl")
    rids = [rid if len(prompts) == 1 else f"{rid}-{i}" for i in range(len(prompts))]
    tt = token_text if req.logprobs is not None else None
    echo = echo_texts(prompts, ctx.tokenizer) if req.echo else None
    streamer = CompletionStreamer(rid, ctx.model_name, req.n, {r: i for i, r in enumerate(rids)}, tt, echo)
    return Call(rid, list(zip(rids, prompts, params)), bool(req.stream), _include_usage(req), "response_format",
                streamer, lambda finals: completion_response(rid, ctx.model_name, finals, req.n, tt, echo))
