"""What a request constrains its output to: a JSON schema, any JSON object, a regex, one of a
list of strings, or a Lark grammar (vLLM's `StructuredOutputsParams`, the same names).

Plain data with no dependency, so `SamplingParams` can hold it; `grammar.py` compiles it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputs:
    json: dict | str | None = None  # a JSON schema (dict or its text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect, which also reads most EBNF)
    # Compact JSON by default: a sampled model can otherwise pad with whitespace without end.
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, "
                f"choice or grammar; got {given or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, not {type(self.json).__name__}")
        if self.choice is not None:
            if (
                not isinstance(self.choice, list)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError("choice must be a non-empty list of non-empty strings")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{k} must be a non-empty string")

    @classmethod
    def coerce(cls, value: Any) -> "StructuredOutputs | None":
        """Accept a StructuredOutputs, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(KINDS) - {"whitespace_flexible"}
            if unknown:
                raise ValueError(f"unknown structured output fields {sorted(unknown)}; use one of {list(KINDS)}")
            return cls(**value)
        raise ValueError(f"structured must be StructuredOutputs or a dict, not {type(value).__name__}")
