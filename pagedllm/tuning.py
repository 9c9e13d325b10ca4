"""Kernel routes and tuning constants: what benchmarks vary to compare one route with another,
and a user never needs. They are not environment variables (settings.py holds those, each one a
user may set): a benchmark takes them as `--tune NAME=VALUE` (pagedllm/bench), a test or a
benchmark's code as `with tuned(quant_wide="gemm"): ...`, a worker process from its spec. The
native library gets the ones it reads through its `set_tuning` op, parsed here: one parser for
Python and C++.

Code reads a value with `get(name)` at the point of use, so a change takes effect at the next
step. This module imports nothing of the package: every layer may ask it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any, Callable, Iterator

logger = logging.getLogger(__name__)


def _knob(default: Any, kind: type, layer: str, doc: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"kind": kind, "layer": layer, "doc": doc, "choices": choices})


@dataclass(frozen=True)
class Tuning:
    # native kernels (C++: passed by the set_tuning op)
    amx: bool = _knob(True, bool, "C++", "false keeps bfloat16 steps over packed weights off the AMX tile product")
    amx_rows: int = _knob(16, int, "C++", "rows from which a bfloat16 step over packed weights takes the AMX tiles")
    prefetch_bytes: int | None = _knob(
        None,
        int,
        "C++",
        "how far ahead the packed kernels prefetch weights (default: by the weights' size against the "
        "last-level cache, and the CPU's vendor; 0: no software prefetch)",
    )
    # quantized weights (quant/)
    quant_int_rows: int = _knob(
        32,
        int,
        "python",
        "steps of up to this many rows take the integer kernel; wider ones dequantize a tile at a time for the GEMM",
    )
    quant_isa: str | None = _knob(
        None,
        str,
        "python",
        "forces the integer kernels' instruction set (default: the best here)",
        ("scalar", "avx2", "avxvnni", "avx512-vnni"),
    )
    quant_wide: str = _knob(
        "auto",
        str,
        "python",
        "the route of steps past quant_int_rows rows: the integer kernel (int), the dequantize + GEMM "
        "route (gemm), or where measured faster (auto)",
        ("auto", "gemm", "int"),
    )
    quant_act: str = _knob(
        "auto",
        str,
        "python",
        "how the integer kernels round activations: one int8 level, two, or by the step's width (auto)",
        ("auto", "int8", "int8x2"),
    )
    quant_x2_wide: str | None = _knob(
        None,
        str,
        "python",
        "projection roles (comma-separated) that auto keeps in two levels on wide steps (default: qkv_proj)",
    )
    quant_head_recheck: int = _knob(
        4, int, "python", "the best logits of a single-level head computed again exactly (0: off)"
    )
    quant_pack: bool = _knob(
        True, bool, "python", "false keeps quantized weights in the file's layout (the reference for comparisons)"
    )
    # pipeline parallelism (distributed/)
    pp_share_head: bool = _knob(
        True,
        bool,
        "python",
        "whether a pipeline's first stage computes part of the LM head's rows (false: the last stage computes it all)",
    )


_FIELDS = {f.name: f for f in fields(Tuning)}
_current = Tuning()
_native_hooks: list[Callable[[Tuning], None]] = []
_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def get(name: str) -> Any:
    """The value of `name` now."""
    return getattr(_current, name)


def current() -> Tuning:
    return _current


def choices(name: str) -> tuple[str, ...]:
    """The values `name` may take (its one definition)."""
    return _FIELDS[name].metadata["choices"]


def configure(**changes: Any) -> Tuning:
    """Set the named values (checked, and parsed where given as text: "0", "false", "512"), and
    hand the native library its part. Returns the tuning that held before, for `tuned`."""
    global _current
    before = _current
    parsed = {name: parse(name, value) for name, value in changes.items()}
    _current = replace(_current, **parsed)
    for hook in _native_hooks:
        hook(_current)
    return before


@contextlib.contextmanager
def tuned(**changes: Any) -> Iterator[Tuning]:
    """The named values for the `with` block, the ones before restored after it."""
    before = configure(**changes)
    try:
        yield _current
    finally:
        configure(**asdict(before))


def parse(name: str, value: Any) -> Any:
    """`value` for knob `name`, checked: text is parsed by the knob's type; a name or value it
    cannot take is a ValueError that lists what it can."""
    f = _FIELDS.get(name)
    if f is None:
        raise ValueError(f"{name!r} is not a tuning knob; the knobs: {', '.join(_FIELDS)}")
    kind, options = f.metadata["kind"], f.metadata["choices"]
    if value is None:
        if f.default is not None:
            raise ValueError(f"{name} needs a value ({kind.__name__}); its default is {f.default!r}")
        return None
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _OFF or text in _ON:
            return text in _ON
        raise ValueError(f"{name}={value!r} is not a boolean (true/false, 1/0)")
    if kind is int:
        try:
            return int(str(value).strip()) if not isinstance(value, int) else value
        except ValueError:
            raise ValueError(f"{name}={value!r} is not an integer") from None
    value = str(value)
    if options is not None and value not in options:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(options)}")
    return value


def from_args(items: list[str] | None) -> dict[str, Any]:
    """`--tune NAME=VALUE` items as configure's keywords, each checked."""
    out = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--tune {item!r}: write NAME=VALUE (the knobs: {', '.join(_FIELDS)})")
        out[name.strip()] = parse(name.strip(), value)
    return out


def on_change(hook: Callable[[Tuning], None]) -> None:
    """Call `hook` with the tuning now and after each change (the native library's setter)."""
    _native_hooks.append(hook)
    hook(_current)


def native_values(t: Tuning) -> tuple[int, int]:
    """What the native `set_tuning` op takes: AMX rows (0: off) and the prefetch distance (-1: auto)."""
    return (t.amx_rows if t.amx else 0), (-1 if t.prefetch_bytes is None else max(0, t.prefetch_bytes))


def table() -> str:
    """The knobs as a Markdown table (docs/benchmarks/tuning.md)."""
    rows = ["| Knob | Type | Default | Read by | What it is for |", "|---|---|---|---|---|"]
    for f in fields(Tuning):
        m = f.metadata
        kind = " \\| ".join(m["choices"]) if m["choices"] else m["kind"].__name__
        default = "unset" if f.default in (None, MISSING) else str(f.default).lower()
        rows.append(f"| `{f.name}` | {kind} | {default} | {m['layer']} | {m['doc']} |")
    return "\n".join(rows) + "\n"


# The variables these knobs were before they left the environment: one still set is ignored,
# and whoever set it is told where the knob went.
RETIRED = {f"PAGEDLLM_{name.upper()}": name for name in _FIELDS}


def warn_retired(environ: Any = None) -> list[str]:
    """Log one warning naming each retired variable still set; returns their names."""
    env = os.environ if environ is None else environ
    found = sorted(v for v in RETIRED if v in env)
    for var in found:
        logger.warning(
            "%s is no longer read: it became the tuning knob %s, which benchmarks take as `--tune %s=VALUE`",
            var,
            RETIRED[var],
            RETIRED[var],
        )
    return found
