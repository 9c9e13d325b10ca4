"""Anthropic Messages over the neutral chat seam: the request model, its translation to neutral
messages, tools and SamplingParams, and the answer as content blocks (whole, or as Anthropic's
stream events).

Claude Code's system prompt opens with an attribution line
(`x-anthropic-billing-header: cc_version=...; cch=...;`) that changes from request to request.
Left in the prompt it would change the first tokens, so no cached prefix would ever match; it
is dropped before templating (it means nothing to a local model); `keep_attribution=True`
(`pagedllm serve --keep-anthropic-attribution`) keeps it."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ...engine.driver import Item
from ...sampling.params import SamplingParams, SamplingParamsError
from ...structured import tools as tool_api
from ..common import chat as neutral
from ..common.call import Call
from ..common.context import ServingContext, new_id
from ..common.errors import ApiError
from .answer import MessageStreamer, message, thought_of

logger = logging.getLogger(__name__)

ATTRIBUTION_PREFIX = "x-anthropic-billing-header:"
MAX_STOP_SEQUENCES = 16
_warned_tools: set[str] = set()  # tool types left out of prompts, each logged once


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")  # metadata, service_tier, ... accepted and unused


class MessageParam(_Model):
    role: str
    content: str | list[dict]


class MessagesRequest(_Model):
    model: str | None = None
    messages: list[MessageParam]
    max_tokens: int = Field(ge=1, le=2**31)  # required, as Anthropic requires it
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None  # {"type": "enabled", "budget_tokens": N} | {"type": "disabled"}
    metadata: dict | None = None


class CountTokensRequest(_Model):
    model: str | None = None
    messages: list[MessageParam]
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None


# -- the request, translated ---------------------------------------------------------------------


def _tool_result_text(result: str | list[dict], where: str) -> str:
    """A tool_result's content as text. Blocks a text model cannot read (an image a Read tool
    returned, a document) become a one-line note, so the agent's loop goes on."""
    if isinstance(result, str):
        return result
    parts = []
    for j, b in enumerate(result):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append(b["text"])
        elif kind == "tool_reference":  # a tool search's answer: that tool is offered from now on
            parts.append(f"Tool {b.get('tool_name', '')} is now available.")
        elif kind in ("image", "document", "search_result"):
            parts.append(f"[{kind} omitted: this server passes tool results to the model as text]")
        else:
            raise ApiError(f"{where}.{j}: unknown block type {kind!r} in a tool_result", param=f"{where}.{j}")
    return "\n".join(parts)


def _text_of(blocks: str | list[dict], where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    parts = []
    for j, b in enumerate(blocks):
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise ApiError(
                f"{where}.{j}: only text blocks are allowed here, got {b.get('type')!r}", param=f"{where}.{j}"
            )
        parts.append(b["text"])
    return "\n".join(parts)


def system_text(system: str | list[dict] | None, keep_attribution: bool) -> str | None:
    """The system prompt as one text; Claude Code's attribution line left out (see the module's
    docstring) unless `keep_attribution`."""
    if system is None:
        return None
    if isinstance(system, str):
        blocks = [{"type": "text", "text": system}]
    else:
        blocks = system
    text = _text_of(blocks, "system")
    if not keep_attribution:
        text = "\n".join(line for line in text.split("\n") if not line.startswith(ATTRIBUTION_PREFIX))
        text = text.lstrip("\n")
    return text or None


def _image_part(b: dict, ctx: ServingContext, where: str) -> dict:
    if ctx.processor is None:
        raise ApiError(
            f"model {ctx.model_name!r} is text-only: it takes no image blocks; send text, "
            "or serve a vision-language model",
            param=where,
        )
    src = b.get("source") or {}
    if src.get("type") == "base64":
        url = f"data:{src.get('media_type', 'image/png')};base64,{src.get('data', '')}"
    elif src.get("type") == "url":
        url = src.get("url", "")
    else:
        raise ApiError(f"{where}: an image's source must be base64 or url", param=where)
    return {"type": "image_url", "image_url": {"url": url}}


def _user_message(i: int, content: list[dict], ctx: ServingContext) -> list[dict]:
    """A user turn: its tool results as tool messages (first, as Anthropic orders them), then
    its text and images as one user message."""
    out, parts = [], []
    for j, b in enumerate(content):
        where = f"messages.{i}.content.{j}"
        kind = b.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": b.get("text", "")})
        elif kind == "image":
            parts.append(_image_part(b, ctx, where))
        elif kind == "tool_result":
            if not b.get("tool_use_id"):
                raise ApiError(f"{where}: a tool_result needs tool_use_id", param=where)
            text = _tool_result_text(b.get("content", ""), f"{where}.content")
            if b.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        elif kind == "document":
            raise ApiError(f"{where}: document blocks are not supported; send the text", param=where)
        else:
            raise ApiError(f"{where}: unknown content block type {kind!r} in a user message", param=where)
    if parts:
        images = any(p["type"] == "image_url" for p in parts)
        out.append({"role": "user", "content": parts if images else "".join(p["text"] for p in parts)})
    return out


def _assistant_message(i: int, content: list[dict]) -> dict:
    text, calls, thoughts = [], [], []
    for j, b in enumerate(content):
        kind = b.get("type")
        if kind == "text":
            text.append(b.get("text", ""))
        elif kind == "tool_use":
            calls.append(
                {
                    "id": b.get("id") or new_id("toolu"),
                    "type": "function",
                    "function": {
                        "name": b.get("name", ""),
                        "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False),
                    },
                }
            )
        elif kind == "thinking":
            thoughts.append(b.get("thinking") or thought_of(b.get("signature")))
        elif kind != "redacted_thinking":
            raise ApiError(
                f"messages.{i}.content.{j}: unknown content block type {kind!r} in an assistant message",
                param=f"messages.{i}.content.{j}",
            )
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        msg["tool_calls"] = calls
    if thoughts:  # templates with reasoning write it back (Qwen3's reasoning_content)
        msg["reasoning_content"] = "\n".join(thoughts)
    return msg


def neutral_messages(
    req: MessagesRequest | CountTokensRequest, ctx: ServingContext, keep_attribution: bool
) -> list[dict]:
    if not req.messages:
        raise ApiError("messages must hold at least one message", param="messages")
    out = []
    system = system_text(req.system, keep_attribution)
    if system is not None:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        if m.role in ("system", "developer"):  # Claude Code's and others' extra roles
            out.append({"role": "system", "content": _text_of(blocks, f"messages.{i}.content")})
        elif m.role == "user":
            out += _user_message(i, blocks, ctx)
        elif m.role == "assistant":
            out.append(_assistant_message(i, blocks))
        else:
            raise ApiError(f"unknown role {m.role!r}; use user or assistant", param=f"messages.{i}.role")
    return out


def _referenced_tools(messages: list[MessageParam]) -> set[str]:
    """The tools a tool search loaded in this conversation (`tool_reference` blocks in tool
    results): a deferred tool is offered to the model from then on."""
    names = set()
    for m in messages:
        for b in m.content if isinstance(m.content, list) else []:
            if isinstance(b, dict) and b.get("type") == "tool_result" and isinstance(b.get("content"), list):
                names |= {
                    r.get("tool_name")
                    for r in b["content"]
                    if isinstance(r, dict) and r.get("type") == "tool_reference"
                }
    return names


def client_tools(tools: list[dict] | None, loaded: set[str]) -> list[dict] | None:
    """The tools the model is offered: client tools, except deferred ones (`defer_loading`) no
    tool search has loaded yet. Anthropic's server tools (web search, code execution, ...) and
    its schema-less client tools (bash_20250124, text_editor_...) cannot run here: they are
    left out of the prompt, with a warning logged once per type, rather than refused."""
    if tools is None:
        return None
    kept = []
    for j, t in enumerate(tools):
        if not isinstance(t, dict):
            raise ApiError(f"tools.{j}: a tool must be an object", param=f"tools.{j}")
        kind = t.get("type")
        if kind not in (None, "custom"):
            if kind not in _warned_tools:
                _warned_tools.add(kind)
                logger.warning(
                    "tool type %r is not run by this server: left out of the prompt "
                    "(client tools with an input_schema are offered to the model)",
                    kind,
                )
            continue
        if t.get("defer_loading") and t.get("name") not in loaded:
            continue
        kept.append(t)
    return kept


def openai_tools(tools: list[dict] | None, choice: dict | None) -> tuple[list[dict] | None, Any, bool | None]:
    """Anthropic's client tools and tool_choice as the seam's function tools, choice and parallelism."""
    if choice is not None and choice.get("type") not in ("auto", "any", "tool", "none"):
        raise ApiError(
            f"tool_choice type {choice.get('type')!r} is unknown; use auto, any, tool or none", param="tool_choice"
        )
    if not tools:
        if choice is not None and choice.get("type") in ("any", "tool"):
            raise ApiError("tool_choice any or tool needs tools", param="tool_choice")
        return None, None, None
    fns = []
    for j, t in enumerate(tools):
        if not t.get("name"):
            raise ApiError(f"tools.{j}: a tool needs a name", param=f"tools.{j}")
        fns.append(
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema") or {"type": "object", "properties": {}},
                },
            }
        )
    kind = (choice or {}).get("type", "auto")
    oa_choice: Any = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        oa_choice = {"type": "function", "function": {"name": choice.get("name")}}
    parallel = None if choice is None or not choice.get("disable_parallel_tool_use") else False
    return fns, oa_choice, parallel


def _thinking_kwargs(thinking: dict | None) -> dict:
    """Anthropic's `thinking` as the template's switch (Qwen3's enable_thinking); a template
    without one ignores it."""
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise ApiError(f"thinking.type {kind!r} is unknown; use enabled or disabled", param="thinking.type")
    return {"enable_thinking": kind != "disabled"}


def prompt_of(
    req: MessagesRequest | CountTokensRequest, ctx: ServingContext, keep_attribution: bool
) -> tuple[list[int] | Any, tool_api.ToolPlan | None]:
    offered = client_tools(req.tools, _referenced_tools(req.messages))
    tools, choice, parallel = openai_tools(offered, req.tool_choice)
    plan = neutral.tool_plan(ctx, tools, choice, parallel)
    ids = neutral.chat_prompt(ctx, neutral_messages(req, ctx, keep_attribution), plan, **_thinking_kwargs(req.thinking))
    return ids, plan


def count_tokens(req: CountTokensRequest, ctx: ServingContext, keep_attribution: bool) -> dict:
    ids, _ = prompt_of(req, ctx, keep_attribution)
    return {"input_tokens": neutral.prompt_len(ids)}


def max_tokens_within(ctx: ServingContext, n_prompt: int, asked: int) -> int:
    """`max_tokens` as a ceiling, not a demand: a request asking for more than the context has
    room for after its prompt is served up to that room and ends with stop_reason "max_tokens"
    (Claude Code asks for 32,000-64,000 whatever the model). Only a prompt that leaves no room
    for one token is refused."""
    if n_prompt >= ctx.max_model_len:
        raise ApiError(
            f"prompt is too long: {n_prompt} tokens > {ctx.max_model_len - 1}, the most this "
            "model's context leaves room for; shorten the messages",
            param="messages",
        )
    return ctx.capped_max_tokens(n_prompt, asked)


def sampling_params(req: MessagesRequest, ctx: ServingContext, n_prompt: int) -> SamplingParams:
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        raise ApiError(
            f"temperature: {req.temperature} is out of range; it must be between 0 and 1", param="temperature"
        )
    if req.top_p is not None and not 0.0 <= req.top_p <= 1.0:
        raise ApiError(f"top_p: {req.top_p} is out of range; it must be between 0 and 1", param="top_p")
    stops = req.stop_sequences or []
    if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
        raise ApiError(f"stop_sequences: at most {MAX_STOP_SEQUENCES} non-empty strings", param="stop_sequences")
    try:
        return SamplingParams(
            max_tokens=max_tokens_within(ctx, n_prompt, req.max_tokens),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if not req.top_k else req.top_k,
            stop=stops or None,
            structured=neutral.structured_spec(_output_format(req), dict(req.model_extra or {})),
        )
    except SamplingParamsError as e:
        raise ApiError(e.message, param=e.param) from None


def _output_format(req: MessagesRequest) -> dict | None:
    """Anthropic's structured output (`output_config.format`, or the older beta's
    `output_format`: {"type": "json_schema", "schema": ...}) as OpenAI's response_format."""
    extra = req.model_extra or {}
    fmt = (extra.get("output_config") or {}).get("format") if isinstance(extra.get("output_config"), dict) else None
    fmt = fmt or extra.get("output_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError(
            'output_config.format must be {"type": "json_schema", "schema": {...}}', param="output_config.format"
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def messages_call(req: MessagesRequest, ctx: ServingContext, keep_attribution: bool = False) -> Call:
    """Validate and prepare a Messages request (raises ApiError)."""
    ids, plan = prompt_of(req, ctx, keep_attribution)
    n_prompt = neutral.prompt_len(ids)
    params = sampling_params(req, ctx, n_prompt)
    neutral.constrain_to_tools(params, plan)
    rid = "msg_" + new_id("x").removeprefix("x-")
    reasoning = neutral.reasoning_of(ctx, ids)
    show = (req.thinking or {}).get("display") != "omitted"
    streamer = MessageStreamer(rid, ctx.model_name, n_prompt, plan, reasoning, show)
    return Call(
        rid,
        [Item(rid, ids, params)],
        req.stream,
        neutral.grammar_param(plan, "messages"),
        streamer,
        lambda finals: message(rid, ctx.model_name, finals[0], plan, reasoning, show),
    )


# -- the model list ----------------------------------------------------------------------------


def wants_anthropic(headers: Any) -> bool:
    """GET /v1/models is both APIs' route: Anthropic's clients say who they are with the
    `anthropic-version` header (every request of theirs carries it), OpenAI's never send it."""
    return "anthropic-version" in headers


def model_info(name: str, created: float) -> dict:
    return {
        "type": "model",
        "id": name,
        "display_name": name,
        "created_at": datetime.fromtimestamp(created, timezone.utc).isoformat().replace("+00:00", "Z"),
    }


def model_list(names: list[str], created: float) -> dict:
    """Anthropic's page of models: every model in one page."""
    return {
        "data": [model_info(n, created) for n in names],
        "has_more": False,
        "first_id": names[0] if names else None,
        "last_id": names[-1] if names else None,
    }


# Anthropic's error types by HTTP status
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(status: int, message_text: str) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message_text}}
