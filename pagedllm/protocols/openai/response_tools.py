"""The tools of a Responses request, as the chat seam's function tools, and the model's calls
back as the Responses items their client expects.

Coding agents send more than function tools (Codex CLI does, on its first request):
- `namespace` tools group functions: each function is offered under its own name (qualified
  with the namespace only where two would clash), and its calls come back as `function_call`
  items that carry the `namespace`.
- `custom` tools take free text, not JSON: offered as a function of one string, `input`, and
  answered as `custom_tool_call` items. A `regex` grammar becomes that string's `pattern`,
  which llguidance enforces wherever the call is constrained (tool_choice naming the tool, or
  required); a `lark` grammar is shown to the model in the tool's description.
- Hosted tools (`web_search`, `image_generation`, `file_search`, `code_interpreter`, ...) run
  on OpenAI's servers, not here: they are left out of the prompt, with a warning logged once
  per type, so the request is answered rather than refused.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...structured.tools import NAME_RE
from ..common.errors import ApiError

logger = logging.getLogger(__name__)

CUSTOM_INPUT = "input"  # the one argument a custom tool is offered with
_warned: set[str] = set()


@dataclass(frozen=True)
class Origin:
    """What a function offered to the model is in the request."""

    name: str  # the tool's own name
    namespace: str | None = None
    custom: bool = False


@dataclass
class ResponseTools:
    """A request's tools, made ready for the chat seam, and the way back for each call."""

    chat: list[dict] | None = None  # the chat seam's function tools
    origins: dict[str, Origin] = field(default_factory=dict)  # offered name -> origin

    @classmethod
    def of(cls, tools: list[dict] | None) -> "ResponseTools":
        if not tools:
            return cls()
        entries: list[tuple[str, dict, Origin]] = []  # (where, tool, origin)
        for i, t in enumerate(tools):
            kind = t.get("type") if isinstance(t, dict) else None
            where = f"tools.{i}"
            if kind == "namespace":
                inner = t.get("tools")
                if not isinstance(inner, list) or not isinstance(t.get("name"), str):
                    raise ApiError("a namespace tool needs a name and a list of tools", param=where)
                for j, f in enumerate(inner):
                    if _offered_kind(f, f"{where}.tools.{j}") is not None:
                        entries.append(
                            (f"{where}.tools.{j}", f, Origin(f["name"], t["name"], f.get("type") == "custom"))
                        )
            elif _offered_kind(t, where) is not None:
                entries.append((where, t, Origin(t["name"], None, kind == "custom")))
        out = cls(chat=[])
        top = {o.name for _, _, o in entries if o.namespace is None}
        for where, t, origin in entries:
            offered = origin.name
            if origin.namespace is not None and (offered in top or offered in out.origins):
                offered = f"{origin.namespace}__{origin.name}"[:64]
            if offered in out.origins:
                raise ApiError(f"tool name {offered!r} is given twice", param=where)
            out.origins[offered] = origin
            out.chat.append({"type": "function", "function": _function(t, offered, origin)})
        return out

    def offered(self, name: str, namespace: str | None = None) -> str:
        """The name the model knows a tool by (for the calls earlier turns made)."""
        for offered, o in self.origins.items():
            if o.name == name and o.namespace == namespace:
                return offered
        return name

    def tool_choice(self, choice: str | dict | None) -> str | dict | None:
        if not isinstance(choice, dict):
            return choice
        kind = choice.get("type")
        if kind in ("function", "custom") and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": self.offered(choice["name"], choice.get("namespace"))}}
        if kind == "allowed_tools":  # a subset of the tools: offered all, in the mode asked
            return choice.get("mode", "auto")
        if kind not in ("function", "custom"):  # a hosted tool's choice: none runs here
            return "auto"
        return choice

    def call_item(self, call: dict, status: str = "completed", item_id: str | None = None) -> dict:
        """The Responses output item for one chat tool call ({"id", "function": {...}})."""
        fn = call["function"]
        origin = self.origins.get(fn["name"], Origin(fn["name"]))
        if origin.custom:
            return {
                "type": "custom_tool_call",
                "id": item_id or new_item_id("ctc"),
                "call_id": call["id"],
                "name": origin.name,
                "input": custom_input(fn["arguments"]),
                "status": status,
            }
        item = {
            "type": "function_call",
            "id": item_id or new_item_id("fc"),
            "call_id": call["id"],
            "name": origin.name,
            "arguments": fn["arguments"],
            "status": status,
        }
        if origin.namespace is not None:
            item["namespace"] = origin.namespace
        return item


def _offered_kind(t: Any, where: str) -> str | None:
    """ "function" or "custom" for a tool the model is offered; None for a hosted tool."""
    kind = t.get("type") if isinstance(t, dict) else None
    if kind in ("function", "custom"):
        if not isinstance(t.get("name"), str) or not NAME_RE.match(t["name"]):
            raise ApiError("a tool name must be 1 to 64 letters, digits, '_' or '-'", param=f"{where}.name")
        return kind
    if not isinstance(kind, str):
        raise ApiError("each tool needs a type", param=f"{where}.type")
    if kind not in _warned:
        _warned.add(kind)
        logger.warning(
            "tool type %r runs on OpenAI's servers, not here: left out of the prompt "
            "(function, custom and namespace tools are offered to the model)",
            kind,
        )
    return None


def _function(t: dict, offered: str, origin: Origin) -> dict:
    if not origin.custom:
        return {"name": offered, **{k: t[k] for k in ("description", "parameters", "strict") if k in t}}
    fmt = t.get("format") or {"type": "text"}
    text: dict[str, Any] = {"type": "string"}
    description = t.get("description", "")
    if fmt.get("type") == "grammar":
        syntax, definition = fmt.get("syntax"), fmt.get("definition")
        if syntax not in ("lark", "regex") or not isinstance(definition, str):
            raise ApiError('a custom tool\'s grammar is {"syntax": "lark" | "regex", "definition": ...}', param="tools")
        if syntax == "regex":  # the whole input matches (a JSON schema's pattern only searches)
            text["pattern"] = f"^(?:{definition})$"
        else:
            description += f"\n\nThe input must follow this Lark grammar:\n{definition}"
    text["description"] = "The tool's input, as free text."
    return {
        "name": offered,
        "description": description,
        "parameters": {
            "type": "object",
            "properties": {CUSTOM_INPUT: text},
            "required": [CUSTOM_INPUT],
            "additionalProperties": False,
        },
    }


def custom_input(arguments: str) -> str:
    """A custom tool call's free text, out of the arguments the model wrote for it."""
    try:
        args = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return arguments
    if isinstance(args, dict) and isinstance(args.get(CUSTOM_INPUT), str):
        return args[CUSTOM_INPUT]
    return arguments


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
