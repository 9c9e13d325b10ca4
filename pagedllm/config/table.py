"""The engine's options as Markdown tables, one per sub-config, for the documentation (the
site's build puts them into docs/configuration.md: tools/mkdocs_hooks.py)."""

from __future__ import annotations

from .engine import SECTIONS
from .option import Option, options_of


def _flags(o: Option) -> str:
    if not o.cli:
        return "(Python only)"
    names = [o.negative] if o.type is bool and o.default else [o.flag, *o.flags]
    return ", ".join(f"`{n}`" for n in names)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    out = []
    for section, cls in SECTIONS.items():
        out += [
            f"### {cls.title[0].upper()}{cls.title[1:]}",
            "",
            _cell((cls.__doc__ or "").strip()),
            "",
            "| `LLM` keyword | Flags | Type | Default | What it is for |",
            "|---|---|---|---|---|",
        ]
        for o in options_of(section, cls):
            default = "unset" if o.default is None else f"`{o.default}`"
            kind = " \\| ".join(o.choices) if o.choices else o.type.__name__
            out.append(f"| `{o.name}` | {_flags(o)} | {kind} | {default} | {_cell(o.help)} |")
        out.append("")
    return "\n".join(out)
