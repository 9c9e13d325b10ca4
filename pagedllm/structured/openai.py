"""OpenAI's `response_format` and vLLM's request extensions, turned into a StructuredOutputs.

- `response_format`: {"type": "text" | "json_object"} or
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}.
- vLLM: `structured_outputs: {"json" | "regex" | "choice" | "grammar": ...}` and the older
  `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` fields.
"""

from __future__ import annotations

from typing import Any

from .params import StructuredOutputs

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredRequestError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def from_response_format(rf: dict | None) -> StructuredOutputs | None:
    if rf is None:
        return None
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise StructuredRequestError(
                "response_format of type 'json_schema' needs a 'json_schema' object holding 'name' and 'schema'",
                "response_format.json_schema",
            )
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:
            # OpenAI allows a schema-less json_schema format: any JSON object then.
            return StructuredOutputs(json_object=True)
        try:
            return StructuredOutputs(json=schema)
        except ValueError as e:
            raise StructuredRequestError(str(e), "response_format.json_schema.schema") from None
    raise StructuredRequestError(
        f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'",
        "response_format.type",
    )


def from_extensions(fields: dict[str, Any]) -> StructuredOutputs | None:
    """vLLM's fields, from a request's extra fields (None when none is set)."""
    so = fields.get("structured_outputs")
    guided = {GUIDED_FIELDS[k]: v for k, v in fields.items() if k in GUIDED_FIELDS and v is not None}
    if so is not None and guided:
        raise StructuredRequestError(
            "give either structured_outputs or guided_* fields, not both", "structured_outputs"
        )
    if so is not None:
        if not isinstance(so, dict):
            raise StructuredRequestError(
                'structured_outputs must be an object such as {"regex": "..."}', "structured_outputs"
            )
        param, value = "structured_outputs", {k: v for k, v in so.items() if v is not None}
    elif guided:
        param, value = "guided_" + next(iter(guided)), guided
    else:
        return None
    try:
        return StructuredOutputs.coerce(value)
    except (TypeError, ValueError) as e:
        raise StructuredRequestError(str(e), param) from None


def from_request(response_format: dict | None, extra: dict[str, Any]) -> StructuredOutputs | None:
    a, b = from_response_format(response_format), from_extensions(extra)
    if a is not None and b is not None:
        raise StructuredRequestError(
            "response_format and structured_outputs/guided_* both constrain the output; give one", "response_format"
        )
    return a or b
