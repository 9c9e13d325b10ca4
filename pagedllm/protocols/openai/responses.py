"""OpenAI's Responses API (`POST /v1/responses`, routed in server/responses.py): the translation.

A request is turned into a chat completion request and runs through the chat route's own
preparation (chat template, sampling, function tools, structured output); its answer (or
stream of chunks) is turned back into a response object (or OpenAI's typed stream events).
Responses are kept in a bounded in-memory store so a later request can continue one with
`previous_response_id`.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from typing import Any, Callable

from pydantic import ValidationError

from ..common.call import SSE_KEEPALIVE
from ..common.errors import ApiError
from .logprobs import usage_from
from .models import ChatCompletionRequest, ChatCompletionResponse, Int, Num, _Model
from .response_tools import ResponseTools, custom_input, new_item_id  # noqa: F401 (re-exported)
from .stream import ChatStreamer

logger = logging.getLogger(__name__)


DEFAULT_STORE_SIZE = 1000
# Sampling fields a Responses request may carry (OpenAI's, then vLLM's extensions), passed on as is.
_PASSED_ON = (
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "user",
    "seed",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
)
# Input items of hosted tools and of state this server does not keep: they carry nothing the
# model can read here, so they are passed over (Codex sends reasoning items back each turn).
_PASSED_OVER = {
    "reasoning",
    "web_search_call",
    "image_generation_call",
    "file_search_call",
    "code_interpreter_call",
    "computer_call",
    "computer_call_output",
    "mcp_list_tools",
    "mcp_call",
    "mcp_approval_request",
    "mcp_approval_response",
    "compaction",
    "tool_search_call",
    "tool_search_output",
    "local_shell_call",
    "local_shell_call_output",
    "item_reference",
}
# Chat parameter names -> the Responses names a client sent.
_PARAM_NAMES = (
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
)


class ResponsesRequest(_Model):
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Int | None = None
    temperature: Num | None = None
    top_p: Num | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    # null is the default (SGLang's gateway forwards unset fields as null)
    stream: bool | None = False
    store: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None


class ResponseStore:
    """The latest responses, for `previous_response_id`: each one's whole conversation as chat
    messages (its instructions aside, which OpenAI does not carry over) and its response object."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()

    def put(self, rid: str, messages: list[dict], response: dict) -> None:
        if self.size <= 0:
            return
        self._items[rid] = (messages, response)
        self._items.move_to_end(rid)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[list[dict], dict] | None:
        item = self._items.get(rid)
        if item is not None:
            self._items.move_to_end(rid)
        return item


# -- request: Responses -> chat ------------------------------------------------------------------


_TEXT_PARTS = ("input_text", "output_text", "text")
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")


def _text_of(content: Any, where: str, tool_output: bool = False) -> str:
    """A message's content, or a tool call's output (`tool_output`): a string or content parts.
    A message's image is refused (this server reads text); in a tool's output (Codex sends images
    there too) it becomes a one-line note, so the agent's loop goes on."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError("content must be a string or a list of content parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif tool_output and kind in _MEDIA_PARTS:
            parts.append(f"[{kind} omitted: this server passes tool outputs to the model as text]")
        else:
            raise ApiError(
                f"content part type {kind!r} is not supported: this server handles text only (input_text, output_text)",
                param=f"{where}.{j}",
            )
    return ("\n" if tool_output else "").join(parts)


def _assistant_call(out: list[dict], call: dict) -> None:
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
        last["tool_calls"].append(call)  # parallel calls: one assistant turn
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def input_messages(inp: str | list[dict], tools: ResponseTools | None = None) -> list[dict]:
    """The `input` as chat messages: messages, earlier tool calls and their outputs."""
    tools = tools or ResponseTools()
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not inp:
        raise ApiError("input is empty: give a string or at least one input item", param="input")
    out: list[dict] = []
    for i, item in enumerate(inp):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(
                    f"unknown role {role!r}; use user, assistant, system or developer", param=f"input.{i}.role"
                )
            out.append({"role": role, "content": _text_of(item.get("content"), f"input.{i}.content")})
        elif kind in ("function_call", "custom_tool_call"):
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name")):
                raise ApiError(f"a {kind} item needs call_id and name", param=f"input.{i}")
            args = (
                item.get("arguments", "{}")
                if kind == "function_call"
                else json.dumps({"input": item.get("input", "")}, ensure_ascii=False)
            )
            _assistant_call(
                out,
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": tools.offered(item["name"], item.get("namespace")), "arguments": args},
                },
            )
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if not isinstance(item.get("call_id"), str):
                raise ApiError(f"a {kind} item needs the call_id it answers", param=f"input.{i}.call_id")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _text_of(item.get("output"), f"input.{i}.output", tool_output=True),
                }
            )
        elif kind in _PASSED_OVER:
            continue  # nothing the model can read here (another model's reasoning, a hosted tool)
        else:
            raise ApiError(
                f"input item type {kind!r} is not supported; use message, function_call, "
                "custom_tool_call or their outputs",
                param=f"input.{i}.type",
            )
    return out


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ApiError("text.format must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}


def chat_request(
    req: ResponsesRequest, history: list[dict], new: list[dict], tools: ResponseTools
) -> ChatCompletionRequest:
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history + new
    body: dict[str, Any] = {
        "messages": messages,
        "tools": tools.chat or None,
        "tool_choice": tools.tool_choice(req.tool_choice) if tools.chat else None,
        "response_format": _response_format(req.text),
        "stream": bool(req.stream),
        "max_completion_tokens": req.max_output_tokens,
    }
    extra = req.model_extra or {}
    for key in _PASSED_ON:
        value = getattr(req, key, None) if key in type(req).model_fields else extra.get(key)
        if value is not None:
            body[key] = value
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:  # a value chat's checks refuse (a range, a type)
        err = e.errors()[0]
        param = str(err["loc"][0]) if err.get("loc") else None
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        raise renamed_error(
            ApiError(f"invalid request: {param}: {msg}" if param else f"invalid request: {msg}", param=param)
        ) from None


def renamed_error(e: ApiError) -> ApiError:
    """A chat preparation error, under the parameter names of the Responses request."""
    if e.param:
        for chat, ours in _PARAM_NAMES:
            if e.param == chat or e.param.startswith(chat + "."):
                e.param = ours + e.param[len(chat) :]
        if e.param.startswith("tools.") and ".function." in e.param:
            e.param = e.param.replace(".function.", ".")
    for chat, ours in _PARAM_NAMES:
        e.message = e.message.replace(chat, ours)
    e.args = (e.message,)
    return e


# -- response objects ------------------------------------------------------------------------


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {
        "type": "message",
        "id": item_id or new_item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def usage_of(u: Any) -> dict:
    return {
        "input_tokens": u.prompt_tokens,
        "output_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens, "cache_write_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }


def skeleton(rid: str, model: str, req: ResponsesRequest) -> dict:
    """The response object before its output: what the request asked, as OpenAI echoes it."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "previous_response_id": req.previous_response_id,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "text": {"format": fmt},
        "truncation": "disabled",
        "store": req.store is not False,
        "usage": None,
        "user": req.user,
    }


def finish(resp: dict, output: list[dict], finish_reason: str | None, usage: dict) -> dict:
    incomplete = finish_reason == "length"
    resp.update(
        output=output,
        usage=usage,
        status="incomplete" if incomplete else "completed",
        incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
    )
    if not incomplete:
        resp["completed_at"] = int(time.time())
    return resp


def output_of(chat: ChatCompletionResponse, tools: ResponseTools) -> tuple[list[dict], str | None]:
    choice = chat.choices[0]
    msg = choice.message
    items = []
    if msg.content or not msg.tool_calls:
        items.append(message_item(msg.content or ""))
    items += [tools.call_item(c) for c in msg.tool_calls or []]
    return items, choice.finish_reason


def as_messages(output: list[dict], tools: ResponseTools) -> list[dict]:
    """A response's output items as the chat messages of its turn (for the next turn)."""
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [
        {
            "id": it["call_id"],
            "type": "function",
            "function": {
                "name": tools.offered(it["name"], it.get("namespace")),
                "arguments": it["arguments"]
                if it["type"] == "function_call"
                else json.dumps({"input": it["input"]}, ensure_ascii=False),
            },
        }
        for it in output
        if it["type"] in ("function_call", "custom_tool_call")
    ]
    msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


# -- streaming -------------------------------------------------------------------------------


class ResponseEvents:
    """OpenAI's typed stream events, built from the chunks of the chat route's own streamer.
    `on_done(response)` runs once the response is complete (the route keeps it)."""

    media_type = "text/event-stream"

    def __init__(
        self, resp: dict, chat: ChatStreamer, tools: ResponseTools, on_done: Callable[[dict], None] = lambda resp: None
    ) -> None:
        self.resp = resp
        self.chat = chat
        self.tools = tools
        self.on_done = on_done
        self.seq = 0
        self.output: list[dict] = []
        self.text: dict | None = None  # the open message item
        self.calls: dict[int, dict] = {}  # open tool-call items by chat tool-call index
        self.arguments: dict[int, str] = {}  # their arguments so far (a custom call's JSON)
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        return [
            self.event("response.created", response=self.resp),
            self.event("response.in_progress", response=self.resp),
        ]

    def events(self, out: Any) -> list[str]:
        events: list[str] = []
        for chunk in self.chat.update(out):
            for choice in chunk.choices:
                d = choice.delta
                if d.content:
                    events += self._text(d.content)
                for tc in d.tool_calls or []:
                    events += self._call(tc)
                if choice.finish_reason is not None:
                    self.finish_reason = choice.finish_reason
        return events

    def _text(self, delta: str) -> list[str]:
        events = []
        if self.text is None:
            self.text = message_item("", "in_progress")
            self.text["content"] = []
            self.output.append(self.text)
            idx = len(self.output) - 1
            events.append(self.event("response.output_item.added", output_index=idx, item=dict(self.text)))
            self.text["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=self.text["id"],
                    output_index=idx,
                    content_index=0,
                    part=dict(self.text["content"][0]),
                )
            )
        self.text["content"][0]["text"] += delta
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=self.text["id"],
                output_index=self.output.index(self.text),
                content_index=0,
                delta=delta,
                logprobs=[],
            )
        )
        return events

    def _close_text(self) -> list[str]:
        item, self.text = self.text, None
        if item is None:
            return []
        idx = self.output.index(item)
        part = item["content"][0]
        item["status"] = "completed"
        return [
            self.event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=idx,
                content_index=0,
                text=part["text"],
                logprobs=[],
            ),
            self.event("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part),
            self.event("response.output_item.done", output_index=idx, item=item),
        ]

    def _call(self, tc: dict) -> list[str]:
        events = self._close_text()  # (a call ends the text before it)
        fn = tc.get("function") or {}
        item = self.calls.get(tc["index"])
        if item is None:  # the chat stream names the function in its first delta of a call
            item = self.tools.call_item(
                {"id": tc.get("id"), "function": {"name": fn.get("name") or "", "arguments": ""}}, "in_progress"
            )
            self.calls[tc["index"]] = item
            self.arguments[tc["index"]] = ""
            self.output.append(item)
            events.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
        if fn.get("arguments"):
            self.arguments[tc["index"]] += fn["arguments"]
            if item["type"] == "function_call":  # a custom call's text is whole once its JSON is
                item["arguments"] += fn["arguments"]
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=self.output.index(item),
                        delta=fn["arguments"],
                    )
                )
        return events

    def end(self, finals: list) -> list[str]:
        events = self._close_text()
        for index, item in self.calls.items():
            idx = self.output.index(item)
            item["status"] = "completed"
            if item["type"] == "custom_tool_call":
                item["input"] = custom_input(self.arguments[index])
                events.append(
                    self.event(
                        "response.custom_tool_call_input.done",
                        item_id=item["id"],
                        output_index=idx,
                        input=item["input"],
                    )
                )
            else:
                events.append(
                    self.event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=idx,
                        name=item["name"],
                        arguments=item["arguments"],
                    )
                )
            events.append(self.event("response.output_item.done", output_index=idx, item=item))
        self.calls = {}
        if not self.output:  # an empty answer is still one (empty) message, as without streaming
            events += self._text("")[:-1] + self._close_text()
        resp = finish(self.resp, self.output, self.finish_reason, usage_of(usage_from(finals)))
        kind = "response.incomplete" if resp["status"] == "incomplete" else "response.completed"
        self.on_done(resp)
        return events + [self.event(kind, response=resp)]

    def keepalive(self) -> list[str]:
        return [SSE_KEEPALIVE]

    def error(self, exc: Exception) -> list[str]:
        """An engine failure mid-stream: the response fails, as OpenAI's stream reports it
        (`response.failed`, which Codex reads, rather than a bare `error` event)."""
        self.resp.update(status="failed", output=self.output, error={"code": "server_error", "message": str(exc)})
        return [self.event("response.failed", response=self.resp)]
