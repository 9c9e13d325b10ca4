"""Anthropic Messages' answer: the whole message's content blocks, or the stream of its events
(`MessageStreamer`), built from the engine's outputs (messages.py reads the request)."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any

from ...outputs import RequestOutput
from ...structured import tools as tool_api
from ..common import chat as neutral
from ..common.context import new_id

# A thinking block's signature carries its text, so a block sent back with its text left out
# (`thinking.display: "omitted"`, or a client that strips it) still reaches the template whole.
SIGNATURE_PREFIX = "pagedllm1."


def signature(thinking: str) -> str:
    """A thinking block's signature: its text, encoded (see SIGNATURE_PREFIX). Nothing is
    secret in it: the model's reasoning is the client's to read."""
    return SIGNATURE_PREFIX + base64.urlsafe_b64encode(thinking.encode()).decode()


def thought_of(sig: Any) -> str:
    """The text a signature of ours carries; "" for anything else (another server's)."""
    if not isinstance(sig, str) or not sig.startswith(SIGNATURE_PREFIX):
        return ""
    try:
        return base64.urlsafe_b64decode(sig[len(SIGNATURE_PREFIX) :]).decode()
    except (binascii.Error, ValueError):
        return ""


def stop_reason(out: Any, called: bool) -> tuple[str, str | None]:
    if called:
        return "tool_use", None
    if out.finish_reason == "length":
        return "max_tokens", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def usage(final: RequestOutput) -> dict:
    n_prompt = final.metrics.num_prompt_tokens
    cached = final.num_cached_tokens
    return {
        "input_tokens": n_prompt - cached,
        "output_tokens": len(final.outputs[0].token_ids),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _tool_use(call: tool_api.ToolCall) -> dict:
    try:
        args = json.loads(call.arguments) if call.arguments else {}
    except json.JSONDecodeError:
        args = {"_raw": call.arguments}
    return {"type": "tool_use", "id": _tool_id(call.id), "name": call.name, "input": args}


def _tool_id(openai_id: str) -> str:
    return "toolu_" + openai_id.removeprefix("call_").removeprefix("chatcmpl-tool-")


def message(
    rid: str,
    model: str,
    final: RequestOutput,
    plan: tool_api.ToolPlan | None,
    reasoning: neutral.Reasoning | None,
    show_thinking: bool = True,
) -> dict:
    out = final.outputs[0]
    thought, text = reasoning.split(out.text) if reasoning is not None else (None, out.text)
    content, calls = neutral.parse_answer(text, plan)
    blocks: list[dict] = []
    if thought is not None:
        blocks.append(
            {"type": "thinking", "thinking": thought if show_thinking else "", "signature": signature(thought)}
        )
    if content:
        blocks.append({"type": "text", "text": content})
    blocks += [_tool_use(c) for c in calls]
    reason, seq = stop_reason(out, bool(calls))
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": usage(final),
    }


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def error_event(message_text: str, kind: str = "api_error") -> str:
    return event("error", {"type": "error", "error": {"type": kind, "message": message_text}})


@dataclass
class MessageStreamer:
    """Anthropic's stream events for one message: message_start and a ping (sent while the
    prompt prefills), then content blocks (thinking, text, tool_use) with increasing indexes,
    then message_delta (stop_reason, usage) and message_stop."""

    rid: str
    model: str
    n_prompt: int
    plan: tool_api.ToolPlan | None
    reasoning: neutral.Reasoning | None
    show_thinking: bool = True  # False: `thinking.display: "omitted"`, the text rides in the signature
    media_type: str = "text/event-stream"
    index: int = -1  # the open block's index
    kind: str | None = None  # the open block's type
    thought: str = ""  # the open thinking block's text (for its signature)
    parser: Any = None
    splitter: Any = None
    done: bool = False
    _ended: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.parser = neutral.answer_stream_parser(self.plan)
        self.splitter = self.reasoning.splitter() if self.reasoning is not None else None

    def start(self) -> list[str]:
        msg = {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self.n_prompt,
                "output_tokens": 0,
                "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0,
            },
        }
        return [event("message_start", {"type": "message_start", "message": msg}), event("ping", {"type": "ping"})]

    def _close(self) -> list[str]:
        if self.kind is None:
            return []
        lines = []
        if self.kind == "thinking":
            lines.append(self._delta({"type": "signature_delta", "signature": signature(self.thought)}))
        lines.append(event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.kind = None
        return lines

    def _open(self, block: dict) -> list[str]:
        lines = self._close()
        self.index += 1
        self.kind, self.thought = block["type"], ""
        return lines + [
            event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        ]

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _thinking(self, text: str) -> list[str]:
        lines = [] if self.kind == "thinking" else self._open({"type": "thinking", "thinking": "", "signature": ""})
        self.thought += text
        return lines + ([self._delta({"type": "thinking_delta", "thinking": text})] if self.show_thinking else [])

    def _text(self, text: str) -> list[str]:
        if self.plan is not None and self.plan.forced and self.parser is not None and self.parser.calls:
            return []  # a forced answer holds nothing but its calls
        lines = [] if self.kind == "text" else self._open({"type": "text", "text": ""})
        return lines + [self._delta({"type": "text_delta", "text": text})]

    def _call(self, d: dict) -> list[str]:
        fn = d.get("function") or {}
        lines = []
        if d.get("id") or fn.get("name"):
            lines += self._open(
                {
                    "type": "tool_use",
                    "id": _tool_id(d.get("id") or new_id("call")),
                    "name": fn.get("name", ""),
                    "input": {},
                }
            )
        if fn.get("arguments"):
            lines.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return lines

    def end(self, finals: list[RequestOutput]) -> list[str]:
        return []  # message_stop went with the last output

    def error(self, exc: Exception) -> list[str]:
        return [error_event(str(exc), "overloaded_error" if "shutting down" in str(exc) else "api_error")]

    def keepalive(self) -> list[str]:
        return [event("ping", {"type": "ping"})]  # Anthropic's own keep-alive

    def events(self, final: RequestOutput) -> list[str]:
        if self.done:
            return []
        out = final.outputs[0]
        thought, text, calls = "", out.delta_text, []
        if self.splitter is not None:
            thought, text = self.splitter.feed(text)
            if out.finish_reason is not None:
                more_thought, more_text = self.splitter.finish()
                thought, text = thought + more_thought, text + more_text
        lines = self._thinking(thought) if thought else []
        if self.parser is not None:
            text, calls = self.parser.feed(text)
            if out.finish_reason is not None:
                more_text, more_calls = self.parser.finish()
                text, calls = text + more_text, calls + more_calls
            # a call's deltas come after the text before it
        if text:
            lines += self._text(text)
        for d in calls:
            lines += self._call(d)
        if out.finish_reason is not None:
            self.done = True
            lines += self._close()
            reason, seq = stop_reason(out, self.parser is not None and self.parser.calls > 0)
            # The whole usage, as Anthropic's stream gives it at the end: message_start went out
            # before the prompt was scheduled, when the tokens read from the prefix cache were
            # not known yet, and clients (Claude Code, the SDK's accumulation) take these.
            lines.append(
                event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": seq},
                        "usage": usage(final),
                    },
                )
            )
            lines.append(event("message_stop", {"type": "message_stop"}))
        return lines
