"""The engine's flags, made from EngineConfig's declared options (config/option.py): a flag's
name is the option's (`block_size` -> `--block-size`), mistral.rs's spellings are its aliases,
its help and default are the option's. On a subcommand a flag defaults to 'not given', so a
value set before the subcommand is not overwritten."""

from __future__ import annotations

import argparse
from typing import Any

from ..config import SECTIONS, EngineConfig, engine_options


def add_engine_flags(p: argparse.ArgumentParser, top: bool) -> None:
    unset = None if top else argparse.SUPPRESS
    groups = {s: p.add_argument_group(f"engine: {cls.title}") for s, cls in SECTIONS.items()}
    for o in engine_options():
        if not o.cli:
            continue
        g = groups[o.section]
        if o.type is bool and o.default:
            g.add_argument(
                o.negative,
                dest=o.name,
                action="store_false",
                default=unset,
                help=f"{o.help}: on unless this flag is given",
            )
            continue
        if o.type is bool:
            g.add_argument(o.flag, *o.flags, dest=o.name, action="store_true", default=unset, help=o.help)
            continue
        kw: dict[str, Any] = {"type": o.type, "metavar": o.metavar} if o.choices is None else {"choices": o.choices}
        g.add_argument(*o.flags, o.flag, dest=o.name, default=unset, help=_help(o.help, o.default), **kw)


def _help(text: str, default: Any) -> str:
    return text if default is None else f"{text} (default: {default})"


def engine_config(args: argparse.Namespace, **given: Any) -> EngineConfig:
    """The EngineConfig of a parsed command line: the flags given, then `given` (the model and
    the places a subcommand's form names it)."""
    flags = {o.name: vars(args)[o.name] for o in engine_options() if o.cli and vars(args).get(o.name) is not None}
    return EngineConfig.from_kwargs(**flags, **{k: v for k, v in given.items() if v is not None})
