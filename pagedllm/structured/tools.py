"""OpenAI tool calling over a model's own chat template.

Three output formats, chosen from what the template itself renders:
- "hermes" (Qwen2.5 and most): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
- "llama3": the whole answer is {"name": ..., "parameters": {...}}
- "mistral": [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
A template that knows nothing of tools gets them described in the system prompt, in the
hermes format. `required` and named calls are constrained by a grammar built from the
functions' JSON schemas, which ends after the call(s); any answer is parsed by one incremental
parser, so a streamed answer (arguments as deltas, as OpenAI streams them) and a whole one agree.
"""
from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .openai import StructuredRequestError
from .params import StructuredOutputs

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_TAG = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
# A forced parallel answer may hold this many calls: the grammar must end somewhere, or a
# model that keeps choosing "one more call" runs to max_tokens.
MAX_PARALLEL_CALLS = 8


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)


@dataclass
class ToolPlan:
    """What a request asks: the tools, how they may be called, and the template's format."""
    tools: list[dict]  # [{"type": "function", "function": {...}}]
    mode: str  # "none" | "auto" | "required" | "named"
    names: list[str]  # the functions a forced call may use
    parallel: bool
    fmt: str
    # Tags the vocabulary holds as single added tokens (Qwen2.5's <tool_call>, Mistral's
    # [TOOL_CALLS]): the grammar names the token, which llguidance never matches to the text.
    tag_ids: dict[str, int] = field(default_factory=dict)

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def grammar(self) -> StructuredOutputs | None:
        if not self.forced:
            return None
        return StructuredOutputs(grammar=forced_grammar(self.tools, self.names, self.fmt, self.parallel,
                                                        self.tag_ids))


def detect_format(template: str | None) -> str:
    t = template or ""
    if MISTRAL_TAG in t:
        return "mistral"
    if PYTHON_TAG in t or ("ipython" in t and "parameters" in t):
        return "llama3"
    return "hermes"


def tag_token_ids(tokenizer: Any) -> dict[str, int]:
    """The call tags that `tokenizer` holds as single added tokens, with their ids."""
    added = {t.content: i for i, t in tokenizer.backend.get_added_tokens_decoder().items()}
    return {tag: added[tag] for tag in (HERMES_OPEN, HERMES_CLOSE, MISTRAL_TAG) if tag in added}


def plan(tools: list[dict] | None, tool_choice: Any, parallel: bool | None, template: str | None,
         tag_ids: dict[str, int] | None = None) -> ToolPlan | None:
    """Check `tools` and `tool_choice` (StructuredRequestError with the param at fault)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise StructuredRequestError("tool_choice needs tools", "tool_choice")
        return None
    funcs = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise StructuredRequestError('each tool must be {"type": "function", "function": {...}}',
                                         f"tools.{i}")
        name = f.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise StructuredRequestError("a function name must be 1 to 64 letters, digits, '_' or '-'",
                                         f"tools.{i}.function.name")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise StructuredRequestError("function parameters must be a JSON schema object",
                                         f"tools.{i}.function.parameters")
        funcs.append({"type": "function", "function": {**f, "parameters": params}})
    names = [f["function"]["name"] for f in funcs]
    if len(set(names)) != len(names):
        raise StructuredRequestError("function names must be unique", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise StructuredRequestError(f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' "
                                         "or a named function", "tool_choice")
        mode, chosen = choice, names
    else:
        name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(choice, dict) or choice.get("type", "function") != "function" or not name:
            raise StructuredRequestError('a named tool_choice is {"type": "function", "function": '
                                         '{"name": ...}}', "tool_choice")
        if name not in names:
            raise StructuredRequestError(f"tool_choice names function {name!r}, which is not among "
                                         f"the tools {names}", "tool_choice")
        mode, chosen = "named", [name]
    return ToolPlan(funcs, mode, chosen, parallel is not False and mode != "named", detect_format(template),
                    dict(tag_ids or {}))


# -- the forced-call grammar ----------------------------------------------------------------


def _rebase_refs(node: Any, base: str) -> Any:
    """A copy of a schema whose local references ("#", "#/$defs/X", ...) point below `base`,
    where the schema now lives inside a larger document."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                out[k] = base + v[1:]
            else:
                out[k] = _rebase_refs(v, base)
        return out
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def _call_schema(tools: list[dict], names: list[str], args_key: str) -> dict:
    """One JSON schema for a call to any of `names`. Each function's parameters move, whole, under
    the root's $defs and are referenced from there, with their own references rebased: a schema
    nested under "arguments" would otherwise point at $defs that are no longer at its root."""
    options, defs = [], {}
    for t in tools:
        f = t["function"]
        if f["name"] not in names:
            continue
        key = f"tool_{len(defs)}"
        defs[key] = _rebase_refs(copy.deepcopy(f["parameters"]), f"#/$defs/{key}")
        options.append({"type": "object", "properties": {"name": {"const": f["name"]},
                                                         args_key: {"$ref": f"#/$defs/{key}"}},
                        "required": ["name", args_key], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs, "x-guidance": {"whitespace_flexible": False}}


def forced_grammar(tools: list[dict], names: list[str], fmt: str, parallel: bool,
                   tag_ids: dict[str, int] | None = None) -> str:
    """A Lark grammar (llguidance's, with %json) whose every sentence is a valid call, or up to
    MAX_PARALLEL_CALLS of them when `parallel`; it ends there, so generation stops."""
    ids = tag_ids or {}

    def tag(text: str) -> str:
        return f"<[{ids[text]}]>" if text in ids else json.dumps(text)

    if fmt == "llama3":
        return "start: %json " + json.dumps(_call_schema(tools, names, "parameters"))
    call = _call_schema(tools, names, "arguments")
    if fmt == "mistral":
        defs = call.pop("$defs")
        arr = {"type": "array", "items": call, "minItems": 1,
               "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
               "$defs": defs, "x-guidance": {"whitespace_flexible": False}}
        return f"start: {tag(MISTRAL_TAG)} %json " + json.dumps(arr)
    # With parallel calls a newline may follow the last one (then only another call or the end
    # may): a model that writes one after </tool_call> is not pushed into a call it did not mean.
    more = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}} "\\n"?' if parallel else ""
    return (f"start: call{more}\n"
            f'call: {tag(HERMES_OPEN)} "\\n" body "\\n" {tag(HERMES_CLOSE)}\n'
            f"body: %json {json.dumps(call)}")


def system_prompt(tools: list[dict]) -> str:
    """Tools described for a template that has no place for them (answered in hermes format)."""
    lines = "\n".join(json.dumps(t) for t in tools)
    return ("You may call functions to help with the user's request. The functions, as JSON "
            f"schemas:\n<tools>\n{lines}\n</tools>\nTo call one, answer with\n{HERMES_OPEN}\n"
            f'{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{HERMES_CLOSE}')


# -- parsing ------------------------------------------------------------------------------------


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
            self._content(self.buf[self.held_from:], out)
        elif self.state == "text":
            self._content(self.buf[self.pos:], out)
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
        self.ws += text[len(body):]

    def _skip_ws(self) -> bool:
        while self.pos < len(self.buf) and self.buf[self.pos] in _WS:
            self.pos += 1
        return self.pos < len(self.buf)

    def _step(self, out: list[str], deltas: list[dict]) -> bool:
        """Handle what the buffer allows in the current state; True when the state changed."""
        buf, st = self.buf, self.state
        if st == "text":  # hermes: content until a call tag
            i = buf.find(HERMES_OPEN, self.pos)
            if i < 0:
                keep = _partial_suffix(buf[self.pos:], HERMES_OPEN)
                self._content(buf[self.pos: len(buf) - keep], out)
                self.pos = len(buf) - keep
                return False
            self._content(buf[self.pos:i], out)
            self.ws_before_tag, self.ws = self.ws, ""
            self.held_from, self.pos, self.state = i, i + len(HERMES_OPEN), "open"
            return True
        if st == "open":  # hermes: after the tag, a call object, or not a call after all
            if not self._skip_ws():
                return False
            if buf[self.pos] == "{":
                return self._begin_object()
            self.ws = self.ws_before_tag
            self._content(buf[self.held_from: self.pos], out)
            self.state = "text"
            return True
        if st == "lead":  # llama3 / mistral: calls only where the answer starts like one
            if not self._skip_ws():
                return False
            rest = buf[self.pos:]
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
        if st == "plain":  # llama3 / mistral: content to the end
            self._content(buf[self.held_from:], out)
            self.held_from = self.pos = len(buf)
            return False
        if st == "obj":
            return self._object(out, deltas)
        if st == "after":  # hermes: after a call object, its closing tag (which may be missing)
            if not self._skip_ws():
                return False
            rest = buf[self.pos:]
            if rest.startswith(HERMES_CLOSE):
                self.pos += len(HERMES_CLOSE)
            elif HERMES_CLOSE.startswith(rest):
                return False
            elif rest[0] == "{":  # another call in the same block
                self.held_from = self.pos
                return self._begin_object()
            self.state = "text"
            return True
        return False

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
                deltas.append({"index": self.calls, "id": new_call_id(), "type": "function",
                               "function": {"name": name, "arguments": ""}})
                self.args, self.sent_args = _JsonScan(m.end()), m.end()
        if self.args is not None:
            self._send_args(deltas)
        if end is None:
            return False
        if self.args is None:  # a whole object that did not start with its name
            try:
                call = _to_call(json.loads(self.buf[self.obj_start:end]))
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a call: it was content
                if self.fmt == "hermes":
                    self.ws = self.ws_before_tag
                self._content(self.buf[self.held_from:end], out)
                self.pos = self.held_from = end
                self.state = "text" if self.fmt == "hermes" else "plain"
                return True
            deltas.append({"index": self.calls, "id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}})
        self.calls += 1
        self.obj = self.args = None
        self.pos = self.held_from = end
        self.state = "after" if self.fmt == "hermes" else "lead"
        return True

    def _send_args(self, deltas: list[dict]) -> None:
        end = self.args.advance(self.buf)
        upto = end if end is not None else len(self.buf)
        if upto > self.sent_args:
            deltas.append({"index": self.calls, "function": {"arguments": self.buf[self.sent_args: upto]}})
            self.sent_args = upto


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
        return "", [{"index": i, "id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def template_messages(messages: list[dict], plan_: ToolPlan | None, template: str | None) -> list[dict]:
    """Messages ready for the template: tool-call arguments as objects (what templates expect),
    and the tools described in the system prompt when the template has no place for them."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                f = dict(c.get("function") or {})
                if isinstance(f.get("arguments"), str):
                    try:
                        f["arguments"] = json.loads(f["arguments"])
                    except json.JSONDecodeError:
                        pass
                calls.append({**c, "function": f, **f})  # both nestings: templates read either
            m["tool_calls"] = calls
            if "tool_calls" not in (template or ""):  # the template would drop them: write them out
                blocks = [f"{HERMES_OPEN}\n" + json.dumps({"name": c.get("name"), "arguments": c.get("arguments")})
                          + f"\n{HERMES_CLOSE}" for c in calls]
                m["content"] = "\n".join(filter(None, [m.get("content") or "", *blocks]))
                del m["tool_calls"]
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if plan_ is not None and "tools" not in (template or ""):
        text = system_prompt(plan_.tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
