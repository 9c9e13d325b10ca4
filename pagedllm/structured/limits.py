"""Bounds on what one request may ask the grammar engine to build, checked before compiling.

llguidance compiles recursively: a JSON schema whose `$defs` chain 3,000 definitions, or a Lark
grammar chaining 3,000 rules, overflows an 8 MiB thread stack and kills the process (SIGSEGV),
and 100,000 choices take a minute and end in a Rust panic. Everything under these limits
compiles in well under a second on 8 MiB stacks (1,000-link chains take ~0.3 s), so the engine
thread, which compiles too when a request has no precompiled matcher, stays safe.
Nesting depth needs no limit of ours: llguidance refuses deep parentheses, regexes and inline
schemas with a clean error.
"""

from __future__ import annotations

import re
from typing import Any

from .params import StructuredOutputs

MAX_SCHEMA_DEFINITIONS = 1000  # entries of `$defs` / `definitions`, all levels together
MAX_SCHEMA_REFS = 1000  # `$ref`s in a schema (or in a Lark grammar's %json schemas)
MAX_SCHEMA_NODES = 20_000  # objects and arrays in a schema
MAX_ENUM_VALUES = 4096  # one `enum`, `anyOf` or `oneOf`
MAX_CHOICES = 4096  # `choice` strings
MAX_GRAMMAR_RULES = 1000  # rules and terminals of a Lark grammar
COMPILE_TIMEOUT_S = 10.0  # what the server waits for one compilation
COMPILE_STACK_BYTES = 64 * 2**20  # stack of the server's compiling threads: far past the limits

_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?[ \t]*:", re.M)
_MAX_ERROR_CHARS = 300


class GrammarLimitError(ValueError):
    """A constraint bigger than the server compiles; the message names the limit."""


def check(spec: StructuredOutputs) -> None:
    kind = spec.kind
    if kind == "json" and isinstance(spec.json, dict):
        check_schema(spec.json)
    elif kind == "choice" and len(spec.choice) > MAX_CHOICES:
        raise GrammarLimitError(f"choice has {len(spec.choice)} strings; the limit is {MAX_CHOICES}")
    elif kind == "grammar":
        rules = len(_LARK_RULE.findall(spec.grammar))
        if rules > MAX_GRAMMAR_RULES:
            raise GrammarLimitError(
                f"the grammar has {rules} rules; the limit is {MAX_GRAMMAR_RULES} rules and terminals"
            )
        refs = spec.grammar.count('"$ref"')
        if refs > MAX_SCHEMA_REFS:
            raise GrammarLimitError(f"the grammar's JSON schemas hold {refs} $refs; the limit is {MAX_SCHEMA_REFS}")


def check_schema(schema: dict) -> None:
    """Count definitions, $refs, nodes and enum sizes without recursion (the schema may be deep)."""
    defs = refs = nodes = 0
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in ("$defs", "definitions"):
                if isinstance(node.get(key), dict):
                    defs += len(node[key])
            refs += "$ref" in node
            for key in ("enum", "anyOf", "oneOf"):
                values = node.get(key)
                if isinstance(values, list) and len(values) > MAX_ENUM_VALUES:
                    raise GrammarLimitError(
                        f"a schema `{key}` has {len(values)} entries; the limit is {MAX_ENUM_VALUES}"
                    )
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        else:
            continue
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise GrammarLimitError(f"the schema has more than {MAX_SCHEMA_NODES} objects and arrays")
    if defs > MAX_SCHEMA_DEFINITIONS:
        raise GrammarLimitError(f"the schema has {defs} definitions ($defs); the limit is {MAX_SCHEMA_DEFINITIONS}")
    if refs > MAX_SCHEMA_REFS:
        raise GrammarLimitError(f"the schema has {refs} $refs; the limit is {MAX_SCHEMA_REFS}")


def clean_error(msg: str) -> str:
    """llguidance's error as one short line: a Rust panic loses its `<backtrace>` frames and
    the quoted grammar source is cut, so clients see what went wrong and nothing else."""
    msg = msg.split("<backtrace>", 1)[0]
    line = " ".join(part.strip() for part in msg.strip().splitlines() if part.strip())
    if line.startswith("panic: "):
        line = "the grammar engine failed: " + line.removeprefix("panic: ")
    return line if len(line) <= _MAX_ERROR_CHARS else line[: _MAX_ERROR_CHARS - 3] + "..."
