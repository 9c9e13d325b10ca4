"""An engine option is a dataclass field that says what it is for: `option()` declares it (its
default, once), and the faces read the declarations instead of listing the options again: the
CLI's flags (cli/flags.py), `LLM`'s keywords (EngineConfig.from_kwargs) and the documentation's
table (docs/hooks.py)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

MISSING = dataclasses.MISSING


def option(
    default: Any,
    help: str,
    *,
    flags: tuple[str, ...] = (),
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    negative: str | None = None,
    cli: bool = True,
) -> Any:
    """A field that is an engine option. `help` is its documentation (a flag's help, a docs
    row); `flags` are the CLI spellings kept beside `--field-name` (mistral.rs's first, so its
    users find theirs); a boolean whose default is True takes `negative`, the flag that turns
    it off. `cli=False`: a keyword of `LLM` only (a value a command line cannot spell)."""
    meta = {"help": help, "flags": flags, "metavar": metavar, "choices": choices, "negative": negative, "cli": cli}
    return dataclasses.field(default=default, metadata={"option": meta})


@dataclass(frozen=True)
class Option:
    """One declared option, as the faces read it."""

    section: str  # the sub-config's attribute on EngineConfig ("cache", "scheduler", ...)
    name: str  # the field's name: LLM's keyword and the --flag-name
    type: type  # int, float, str or bool (Optional unwrapped)
    default: Any
    help: str
    flags: tuple[str, ...]
    metavar: str | None
    choices: tuple[str, ...] | None
    negative: str | None
    cli: bool

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def options_of(section: str, cls: type) -> list[Option]:
    """The options a sub-config declares, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("option")
        if meta is None:
            continue
        out.append(
            Option(
                section,
                f.name,
                _scalar(hints[f.name], f.name),
                f.default,
                meta["help"],
                meta["flags"],
                meta["metavar"],
                meta["choices"],
                meta["negative"],
                meta["cli"],
            )
        )
    return out


def _scalar(hint: Any, name: str) -> type:
    """int from `int | None`, and so on; an option is one scalar (a dict travels with cli=False)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if len(args) != 1:
        raise TypeError(f"option {name}: one type or that type | None, not {hint}")
    origin = typing.get_origin(args[0]) or args[0]
    return origin
