"""OpenAI tool calling over a model's own chat template.

Three output formats, chosen from what the template itself renders:
- "hermes" (Qwen2.5 and most): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
- "llama3": the whole answer is {"name": ..., "parameters": {...}}
- "mistral": [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
A template that knows nothing of tools gets them described in the system prompt, in the
hermes format. `required` and named calls are constrained by a grammar built from the
functions' JSON schemas, which ends after the call(s). Reading the calls out of an answer,
whole or streamed, is tool_parser.py's.
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
        return StructuredOutputs(grammar=forced_grammar(self.tools, self.names, self.fmt, self.parallel, self.tag_ids))


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


def plan(
    tools: list[dict] | None,
    tool_choice: Any,
    parallel: bool | None,
    template: str | None,
    tag_ids: dict[str, int] | None = None,
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
            raise StructuredRequestError('each tool must be {"type": "function", "function": {...}}', f"tools.{i}")
        name = f.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise StructuredRequestError(
                "a function name must be 1 to 64 letters, digits, '_' or '-'", f"tools.{i}.function.name"
            )
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise StructuredRequestError(
                "function parameters must be a JSON schema object", f"tools.{i}.function.parameters"
            )
        funcs.append({"type": "function", "function": {**f, "parameters": params}})
    names = [f["function"]["name"] for f in funcs]
    if len(set(names)) != len(names):
        raise StructuredRequestError("function names must be unique", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise StructuredRequestError(
                f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' or a named function", "tool_choice"
            )
        mode, chosen = choice, names
    else:
        name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(choice, dict) or choice.get("type", "function") != "function" or not name:
            raise StructuredRequestError(
                'a named tool_choice is {"type": "function", "function": {"name": ...}}', "tool_choice"
            )
        if name not in names:
            raise StructuredRequestError(
                f"tool_choice names function {name!r}, which is not among the tools {names}", "tool_choice"
            )
        mode, chosen = "named", [name]
    return ToolPlan(
        funcs, mode, chosen, parallel is not False and mode != "named", detect_format(template), dict(tag_ids or {})
    )


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
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, args_key: {"$ref": f"#/$defs/{key}"}},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs, "x-guidance": {"whitespace_flexible": False}}


def forced_grammar(
    tools: list[dict], names: list[str], fmt: str, parallel: bool, tag_ids: dict[str, int] | None = None
) -> str:
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
        arr = {
            "type": "array",
            "items": call,
            "minItems": 1,
            "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
            "$defs": defs,
            "x-guidance": {"whitespace_flexible": False},
        }
        return f"start: {tag(MISTRAL_TAG)} %json " + json.dumps(arr)
    # With parallel calls a newline may follow the last one (then only another call or the end
    # may): a model that writes one after </tool_call> is not pushed into a call it did not mean.
    more = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}} "\\n"?' if parallel else ""
    return (
        f"start: call{more}\n"
        f'call: {tag(HERMES_OPEN)} "\\n" body "\\n" {tag(HERMES_CLOSE)}\n'
        f"body: %json {json.dumps(call)}"
    )


def system_prompt(tools: list[dict]) -> str:
    """Tools described for a template that has no place for them (answered in hermes format)."""
    lines = "\n".join(json.dumps(t) for t in tools)
    return (
        "You may call functions to help with the user's request. The functions, as JSON "
        f"schemas:\n<tools>\n{lines}\n</tools>\nTo call one, answer with\n{HERMES_OPEN}\n"
        f'{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{HERMES_CLOSE}'
    )


# -- parsing ------------------------------------------------------------------------------------


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
                blocks = [
                    f"{HERMES_OPEN}\n"
                    + json.dumps({"name": c.get("name"), "arguments": c.get("arguments")})
                    + f"\n{HERMES_CLOSE}"
                    for c in calls
                ]
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
