"""OpenAI's chat and text-completion calls: a request made ready for the engine (through
translate.py), and the whole answer built from the engine's final outputs."""

from __future__ import annotations

from ...engine.driver import Item
from ...outputs import RequestOutput
from ...structured import tools as tool_api
from ..common import chat as neutral
from ..common.call import Call
from ..common.context import ServingContext, new_id
from ..common.tokens import TokenText
from .logprobs import chat_logprobs, completion_logprobs, echo_texts, join_logprobs, prompt_logprobs, usage_from
from .models import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ResponseMessage,
)
from .stream import SYSTEM_FINGERPRINT, ChatStreamer, CompletionStreamer, OpenAIFraming, finish_reason
from .translate import prepare_chat_plan, prepare_completion


def _tool_call_dicts(calls: list[tool_api.ToolCall]) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def chat_response(
    rid: str,
    model: str,
    final: RequestOutput,
    tt: TokenText | None,
    tools: tool_api.ToolPlan | None = None,
    reasoning: neutral.Reasoning | None = None,
) -> ChatCompletionResponse:
    choices = []
    for c in final.outputs:
        lp = chat_logprobs(c.logprobs or [], tt) if tt is not None else None
        thought, text = reasoning.split(c.text) if reasoning is not None else (None, c.text)
        content, calls = neutral.parse_answer(text, tools)
        msg = ResponseMessage(content=content, reasoning_content=thought, tool_calls=_tool_call_dicts(calls) or None)
        choices.append(
            ChatChoice(
                index=c.index,
                message=msg,
                logprobs=lp,
                finish_reason=finish_reason(c.finish_reason, tools, bool(calls)),
                stop_reason=c.stop_reason,
            )
        )
    return ChatCompletionResponse(
        id=rid, model=model, choices=choices, usage=usage_from([final]), system_fingerprint=SYSTEM_FINGERPRINT
    )


def completion_response(
    rid: str, model: str, finals: list[RequestOutput], n: int, tt: TokenText | None, echo: list[str] | None
) -> CompletionResponse:
    choices = []
    for p, out in enumerate(finals):
        prefix = echo[p] if echo else ""
        for c in out.outputs:
            lp = completion_logprobs(c.logprobs or [], tt, len(prefix)) if tt is not None else None
            if lp is not None and echo and out.prompt_logprobs is not None:
                lp = join_logprobs(prompt_logprobs(out, tt, len(prefix)), lp)
            choices.append(
                CompletionChoice(
                    index=p * n + c.index,
                    text=prefix + c.text,
                    logprobs=lp,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
    return CompletionResponse(
        id=rid, model=model, choices=choices, usage=usage_from(finals), system_fingerprint=SYSTEM_FINGERPRINT
    )


def _include_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def _continuous_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(_include_usage(req) and req.stream_options.continuous_usage_stats)


def chat_call(req: ChatCompletionRequest, ctx: ServingContext, token_text: TokenText) -> Call:
    """Validate and prepare a chat request (raises ApiError); its tool plan parses the answer."""
    ids, params, tools = prepare_chat_plan(req, ctx)
    rid = new_id("chatcmpl")
    tt = token_text if req.logprobs else None
    reasoning = neutral.reasoning_of(ctx, ids)
    streamer = ChatStreamer(rid, ctx.model_name, req.n, tt, tools, reasoning)
    grammar_param = neutral.grammar_param(tools, "response_format")
    return Call(
        rid,
        [Item(rid, ids, params)],
        bool(req.stream),
        grammar_param,
        OpenAIFraming(streamer, _include_usage(req), _continuous_usage(req)),
        lambda finals: chat_response(rid, ctx.model_name, finals[0], tt, tools, reasoning),
        streamer,
        _include_usage(req),
    )


def completion_call(req: CompletionRequest, ctx: ServingContext, token_text: TokenText) -> Call:
    """Validate and prepare a text-completion request (raises ApiError): one engine request per
    prompt, each with n completions."""
    prompts, ids, params = prepare_completion(req, ctx)
    rid = new_id("cmpl")
    rids = [rid if len(prompts) == 1 else f"{rid}-{i}" for i in range(len(prompts))]
    tt = token_text if req.logprobs is not None else None
    echo = echo_texts(prompts, ctx.tokenizer) if req.echo else None
    streamer = CompletionStreamer(rid, ctx.model_name, req.n, {r: i for i, r in enumerate(rids)}, tt, echo)
    return Call(
        rid,
        [Item(*it) for it in zip(rids, ids, params)],
        bool(req.stream),
        "response_format",
        OpenAIFraming(streamer, _include_usage(req), _continuous_usage(req)),
        lambda finals: completion_response(rid, ctx.model_name, finals, req.n, tt, echo),
        streamer,
        _include_usage(req),
    )
