"""Reading tool calls out of a model's answer: the whole answer (`parse`), or as it streams
(`StreamParser` for the template's own format, `AutoStreamParser` for tool_choice=auto, which
also takes a bare or fenced JSON call naming one of the request's tools). Both give the same
calls for the same text, however it is cut into pieces. tools.py plans the calls and
constrains forced ones; this module only reads what the model wrote.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .tools import HERMES_CLOSE, HERMES_OPEN, MISTRAL_TAG, PYTHON_TAG, ToolCall, new_call_id


def _to_call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def parse(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """Split a finished answer into its text content and its tool calls (the stream parser run
    over the whole text, so both agree)."""
    p = StreamParser(fmt)
    content, deltas = p.feed(text)
    more, more_deltas = p.finish()
    calls = merge_deltas(deltas + more_deltas)
    if not calls:
        return text, []
    return (content + more).strip() or None, calls


_FENCE = re.compile(r"^```[A-Za-z0-9_-]*\s*\n(.*?)\n?```$", re.S)


def bare_json_calls(text: str, names: list[str]) -> list[ToolCall]:
    """Calls written as a bare or fenced JSON object (or list of them), `{"name": ...,
    "arguments": {...}}`, without the template's tags, as small models often answer (llama.cpp's
    parser accepts them). Only a whole answer that is such JSON, and only when every name is one
    of `names` (the request's tools): any other JSON answer stays content."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    if not body.startswith(("{", "[")):
        return []
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = []
    for it in items:
        if not isinstance(it, dict) or it.get("name") not in names:
            return []
        args = it.get("arguments", it.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return []
        if not isinstance(args, dict) or set(it) - {"name", "arguments", "parameters", "type", "id"}:
            return []
        calls.append(ToolCall(it["name"], json.dumps(args, ensure_ascii=False)))
    return calls


def merge_deltas(deltas: list[dict]) -> list[ToolCall]:
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        f = d.get("function", {})
        if d["index"] not in calls:
            calls[d["index"]] = ToolCall(f.get("name", ""), "", d.get("id") or new_call_id())
        calls[d["index"]].arguments += f.get("arguments", "")
    return [calls[i] for i in sorted(calls)]


# A call object that starts with its name, then its arguments: the arguments stream from here.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=[\[{])')
_WS = " \t\r\n"


class _JsonScan:
    """Finds where a JSON object or array that starts at `start` ends, fed as text arrives."""

    def __init__(self, start: int) -> None:
        self.pos, self.depth, self.in_str, self.esc = start, 0, False, False
        self.end: int | None = None

    def advance(self, text: str) -> int | None:
        i = self.pos
        while self.end is None and i < len(text):
            c = text[i]
            i += 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i
        self.pos = i
        return self.end


class StreamParser:
    """Incremental `parse` for streaming: feed text deltas, get (content to send now, tool-call
    deltas in OpenAI's streamed shape). A call's id and name go out once its head
    `{"name": ..., "arguments": ` is read, then its arguments as they arrive. Text that may still
    turn into a call is held back, and so is whitespace, which is dropped next to calls."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.buf = ""  # all text so far; the positions below index it
        self.pos = 0  # the first character not yet handled
        self.state = "text" if fmt == "hermes" else "lead"
        self.held_from = 0  # where held text that may yet be content starts (a tag, the lead)
        self.ws = ""  # whitespace held back from content
        self.ws_before_tag = ""
        self.calls = 0  # calls begun so far (the index of the next)
        self.obj_start = 0
        self.obj: _JsonScan | None = None  # the current call object
        self.args: _JsonScan | None = None  # its arguments, once its head was read
        self.sent_args = 0  # where the arguments not yet sent start

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.buf += delta
        out: list[str] = []
        deltas: list[dict] = []
        while self._step(out, deltas):
            pass
        return "".join(out), deltas

    def finish(self) -> tuple[str, list[dict]]:
        out: list[str] = []
        deltas: list[dict] = []
        while self._step(out, deltas):
            pass
        if self.state == "obj" and self.args is not None:  # cut short (max_tokens)
            self._send_args(deltas)
            self.calls += 1
        elif self.state in ("open", "obj", "plain") or self.state == "lead" and not self.calls:
            if self.state == "open":
                self.ws = self.ws_before_tag
            self._content(self.buf[self.held_from :], out)
        elif self.state == "text":
            self._content(self.buf[self.pos :], out)
        if not self.calls and self.ws:
            out.append(self.ws)
        self.ws = ""
        self.held_from = self.pos = len(self.buf)
        self.state = "done"
        return "".join(out), deltas

    # -- internals ------------------------------------------------------------------------
    def _content(self, text: str, out: list[str]) -> None:
        """Send text, keeping back its trailing whitespace (it may border a call)."""
        body = text.rstrip(_WS)
        if body:
            out.append(self.ws + body)
            self.ws = ""
        self.ws += text[len(body) :]

    def _skip_ws(self) -> bool:
        while self.pos < len(self.buf) and self.buf[self.pos] in _WS:
            self.pos += 1
        return self.pos < len(self.buf)

    def _step(self, out: list[str], deltas: list[dict]) -> bool:
        """Handle what the buffer allows in the current state; True when the state changed."""
        if self.state == "obj":
            return self._object(out, deltas)
        step = _STATE_STEPS.get(self.state)
        return step(self, out) if step is not None else False

    def _in_text(self, out: list[str]) -> bool:
        """hermes: content until a call tag."""
        buf = self.buf
        i = buf.find(HERMES_OPEN, self.pos)
        if i < 0:
            keep = _partial_suffix(buf[self.pos :], HERMES_OPEN)
            self._content(buf[self.pos : len(buf) - keep], out)
            self.pos = len(buf) - keep
            return False
        self._content(buf[self.pos : i], out)
        self.ws_before_tag, self.ws = self.ws, ""
        self.held_from, self.pos, self.state = i, i + len(HERMES_OPEN), "open"
        return True

    def _in_open(self, out: list[str]) -> bool:
        """hermes: after the tag, a call object, or not a call after all."""
        if not self._skip_ws():
            return False
        if self.buf[self.pos] == "{":
            return self._begin_object()
        self.ws = self.ws_before_tag
        self._content(self.buf[self.held_from : self.pos], out)
        self.state = "text"
        return True

    def _in_lead(self, out: list[str]) -> bool:
        """llama3 / mistral: calls only where the answer starts like one."""
        if not self._skip_ws():
            return False
        rest = self.buf[self.pos :]
        for tag in (MISTRAL_TAG, PYTHON_TAG):
            if rest.startswith(tag):
                self.pos += len(tag)
                return True
            if tag.startswith(rest):
                return False
        c = rest[0]
        if c == "{":
            return self._begin_object()
        if c in "[,;]":
            self.pos += 1
            return True
        if self.calls:
            self.held_from = self.pos
        self.state = "plain"
        return True

    def _in_plain(self, out: list[str]) -> bool:
        """llama3 / mistral: content to the end."""
        self._content(self.buf[self.held_from :], out)
        self.held_from = self.pos = len(self.buf)
        return False

    def _in_after(self, out: list[str]) -> bool:
        """hermes: after a call object, its closing tag (which may be missing)."""
        if not self._skip_ws():
            return False
        rest = self.buf[self.pos :]
        if rest.startswith(HERMES_CLOSE):
            self.pos += len(HERMES_CLOSE)
        elif HERMES_CLOSE.startswith(rest):
            return False
        elif rest[0] == "{":  # another call in the same block
            self.held_from = self.pos
            return self._begin_object()
        self.state = "text"
        return True

    def _begin_object(self) -> bool:
        self.ws = ""
        self.obj_start, self.obj, self.args, self.state = self.pos, _JsonScan(self.pos), None, "obj"
        return True

    def _object(self, out: list[str], deltas: list[dict]) -> bool:
        end = self.obj.advance(self.buf)
        if self.args is None:
            m = _HEAD.match(self.buf, self.obj_start)
            if m is not None:
                try:
                    name = json.loads(f'"{m.group(1)}"')
                except json.JSONDecodeError:
                    name = m.group(1)
                deltas.append(
                    {
                        "index": self.calls,
                        "id": new_call_id(),
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }
                )
                self.args, self.sent_args = _JsonScan(m.end()), m.end()
        if self.args is not None:
            self._send_args(deltas)
        if end is None:
            return False
        if self.args is None:  # a whole object that did not start with its name
            try:
                call = _to_call(json.loads(self.buf[self.obj_start : end]))
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a call: it was content
                if self.fmt == "hermes":
                    self.ws = self.ws_before_tag
                self._content(self.buf[self.held_from : end], out)
                self.pos = self.held_from = end
                self.state = "text" if self.fmt == "hermes" else "plain"
                return True
            deltas.append(
                {
                    "index": self.calls,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            )
        self.calls += 1
        self.obj = self.args = None
        self.pos = self.held_from = end
        self.state = "after" if self.fmt == "hermes" else "lead"
        return True

    def _send_args(self, deltas: list[dict]) -> None:
        end = self.args.advance(self.buf)
        upto = end if end is not None else len(self.buf)
        if upto > self.sent_args:
            deltas.append({"index": self.calls, "function": {"arguments": self.buf[self.sent_args : upto]}})
            self.sent_args = upto


_STATE_STEPS = {  # the parser's state -> what it does with the buffer there (obj: _object)
    "text": StreamParser._in_text,
    "open": StreamParser._in_open,
    "lead": StreamParser._in_lead,
    "plain": StreamParser._in_plain,
    "after": StreamParser._in_after,
}


class AutoStreamParser:
    """`StreamParser` for tool_choice=auto that also reads a whole answer of bare or fenced JSON
    naming one of `names` as its calls, as `bare_json_calls` reads a whole answer: while the
    answer may still be such JSON (it starts with `{`, `[` or a fence), what it says is held
    back; at its end it is those calls, or the content it was."""

    def __init__(self, fmt: str, names: list[str]) -> None:
        self.inner, self.names = StreamParser(fmt), names
        self.text = ""
        self.holding = True
        self.held_text: list[str] = []
        self.held_deltas: list[dict] = []
        self.bare = 0  # calls read from bare JSON

    @property
    def calls(self) -> int:
        return self.inner.calls + self.bare

    def _may_be_json(self) -> bool:
        head = self.text.lstrip(_WS)[:3]
        return not head or head[0] in "{[" or "```".startswith(head)

    def _release(self, text: str, deltas: list[dict]) -> tuple[str, list[dict]]:
        text, deltas = "".join(self.held_text) + text, self.held_deltas + deltas
        self.held_text, self.held_deltas = [], []
        return text, deltas

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        text, deltas = self.inner.feed(delta)
        if not self.holding:
            return text, deltas
        self.text += delta
        if self._may_be_json():
            self.held_text.append(text)
            self.held_deltas += deltas
            return "", []
        self.holding = False
        return self._release(text, deltas)

    def finish(self) -> tuple[str, list[dict]]:
        text, deltas = self.inner.finish()
        if not self.holding:
            return text, deltas
        self.holding = False
        text, deltas = self._release(text, deltas)
        calls = [] if deltas else bare_json_calls(self.text, self.names)
        if not calls:
            return text, deltas
        self.bare = len(calls)
        return "", [
            {"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)
        ]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
