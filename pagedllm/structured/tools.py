"""OpenAI tool calling over a model's own chat template.

Three output formats, chosen from what the template itself renders:
- "hermes" (Qwen2.5 and most): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
- "llama3": the whole answer is {"name": ..., "parameters": {...}}
- "mistral": [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
A template that knows nothing of tools gets them described in the system prompt, in the
hermes format. `required` and named calls are constrained by a grammar built from the
functions' JSON schemas; `auto` output is parsed, also incrementally for streaming.
"""
from __future__ import annotations

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


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass
class ToolPlan:
    """What a request asks: the tools, how they may be called, and the template's format."""
    tools: list[dict]  # [{"type": "function", "function": {...}}]
    mode: str  # "none" | "auto" | "required" | "named"
    names: list[str]  # the functions a forced call may use
    parallel: bool
    fmt: str

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def grammar(self) -> StructuredOutputs | None:
        if self.mode not in ("required", "named"):
            return None
        return StructuredOutputs(grammar=forced_grammar(self.tools, self.names, self.fmt, self.parallel))


def detect_format(template: str | None) -> str:
    t = template or ""
    if MISTRAL_TAG in t:
        return "mistral"
    if "<|python_tag|>" in t or ("ipython" in t and "parameters" in t):
        return "llama3"
    return "hermes"


def plan(tools: list[dict] | None, tool_choice: Any, parallel: bool | None, template: str | None
         ) -> ToolPlan | None:
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
    return ToolPlan(funcs, mode, chosen, parallel is not False and mode != "named", detect_format(template))


def _call_schema(tools: list[dict], names: list[str], args_key: str) -> dict:
    options = []
    for t in tools:
        f = t["function"]
        if f["name"] in names:
            options.append({"type": "object", "properties": {"name": {"const": f["name"]},
                                                             args_key: f["parameters"]},
                            "required": ["name", args_key], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def forced_grammar(tools: list[dict], names: list[str], fmt: str, parallel: bool) -> str:
    """A Lark grammar (llguidance's, with %json) whose every sentence is a valid call."""
    if fmt == "llama3":
        return "start: %json " + json.dumps(_call_schema(tools, names, "parameters"))
    call = _call_schema(tools, names, "arguments")
    if fmt == "mistral":
        arr = {"type": "array", "items": call, "minItems": 1, "x-guidance": {"whitespace_flexible": False}}
        if not parallel:
            arr["maxItems"] = 1
        return "start: %json " + json.dumps(arr)
    more = ' ("\\n" call)*' if parallel else ""
    return (f"start: call{more}\n"
            f'call: "{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"\n'
            f"body: %json {json.dumps(call)}")


def system_prompt(tools: list[dict]) -> str:
    """Tools described for a template that has no place for them (answered in hermes format)."""
    lines = "\n".join(json.dumps(t) for t in tools)
    return ("You may call functions to help with the user's request. The functions, as JSON "
            f"schemas:\n<tools>\n{lines}\n</tools>\nTo call one, answer with\n{HERMES_OPEN}\n"
            f'{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{HERMES_CLOSE}')


def _to_call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def parse(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """Split a finished answer into its text content and its tool calls."""
    if fmt == "hermes":
        calls, content, pos = [], [], 0
        for m in re.finditer(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_CLOSE) + r"|$)",
                             text, re.S):
            try:
                call = _to_call(json.loads(m.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:
                continue
            content.append(text[pos:m.start()])
            pos = m.end()
            calls.append(call)
        content.append(text[pos:])
        rest = "".join(content).strip()
        return (rest or None) if calls else text, calls
    body = text.strip().removeprefix(MISTRAL_TAG).removeprefix("<|python_tag|>").strip()
    if not body.startswith(("{", "[")):
        return text, []
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return text, []
    items = obj if isinstance(obj, list) else [obj]
    calls = [_to_call(o) for o in items]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, calls


class StreamParser:
    """Incremental `parse` for streaming: feed text deltas, get content to send now and the
    calls completed so far; text that may still turn into a call is held back."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.buf = ""  # held text
        self.sent_content = False
        self.calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        if self.fmt != "hermes":
            # A call is the whole answer: hold everything once it starts like one.
            head = self.buf.lstrip()
            if self.sent_content or (head and not head.startswith(("{", "[", MISTRAL_TAG[: len(head)],
                                                                    "<|python_tag|>"[: len(head)]))):
                out, self.buf, self.sent_content = self.buf, "", True
                return out, []
            return "", []
        content, calls = "", []
        while True:
            i = self.buf.find(HERMES_OPEN)
            if i < 0:
                keep = _partial_suffix(self.buf, HERMES_OPEN)
                content += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            content += self.buf[:i]
            j = self.buf.find(HERMES_CLOSE, i)
            if j < 0:
                self.buf = self.buf[i:]
                break
            _, got = parse(self.buf[i: j + len(HERMES_CLOSE)], "hermes")
            calls += got
            self.buf = self.buf[j + len(HERMES_CLOSE):]
        if calls:
            content = content.strip("\n") if not content.strip() else content
        self.calls += len(calls)
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = parse(self.buf, self.fmt) if self.buf else (None, [])
        self.buf = ""
        self.calls += len(calls)
        return content or "", calls


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
