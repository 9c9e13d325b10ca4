"""Every `PAGEDLLM_*` environment variable, in one typed, frozen `Settings`.

Each field names its variable, its type, default and which layer reads it: this package
(`python`), the native library when it loads or first runs a kernel (`C++`, native/csrc), or the
build (`setup.py`). docs/configuration.md is the table of them (tests/test_settings.py checks
that it lists exactly these fields). Python code reads a variable only through `get` at the
point of use, so a variable changed after import (a test's monkeypatch.setenv, a benchmark
trying both routes) takes effect; `Settings.from_env()` reads them all at once.

Kernel routes and tuning constants that only benchmarks vary are not here: they are
pagedllm/tuning.py's knobs, out of the environment.

This module imports nothing of the package: every layer may ask it.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields
from functools import lru_cache
from typing import Any

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def _var(env: str, default: Any, kind: type, layer: str, doc: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"env": env, "kind": kind, "layer": layer, "doc": doc, "choices": choices})


@dataclass(frozen=True)
class Settings:
    # native kernels (native/)
    native: bool = _var(
        "PAGEDLLM_NATIVE", True, bool, "python", "0 turns the native CPU kernels off: the PyTorch paths run"
    )
    native_isa: str | None = _var(
        "PAGEDLLM_NATIVE_ISA",
        None,
        str,
        "python, C++ (dispatch.cpp)",
        "caps the kernels' instruction-set level (default: the CPU's best; avxvnni only when named)",
        ("base", "avx2", "avxvnni", "avx512vnni", "avx512bf16"),
    )
    huge_pages: bool = _var(
        "PAGEDLLM_HUGE_PAGES",
        True,
        bool,
        "C++ (weight_memory.cpp)",
        "0 keeps weights out of the 2 MiB-aligned slabs marked for transparent huge pages",
    )
    build_kernels: bool = _var(
        "PAGEDLLM_BUILD_KERNELS", True, bool, "setup.py", "0 builds the package without the native kernels"
    )
    isa_levels: str = _var(
        "PAGEDLLM_ISA_LEVELS",
        "native",
        str,
        "setup.py",
        "the kernels' instruction-set levels to compile: native (the baseline and "
        "this CPU's best, and the avxvnni build it runs), all (every level, for a wheel), or a comma "
        "list of levels (avxvnni_evex: the avxvnni level's EVEX twin)",
    )
    # memory, limits, distribution, serving
    keep_buffers: bool = _var(
        "PAGEDLLM_KEEP_BUFFERS",
        True,
        bool,
        "python",
        "0 leaves glibc's mmap and trim thresholds as they are after loading",
    )
    allow_long_max_model_len: bool = _var(
        "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN",
        False,
        bool,
        "python",
        "1 allows a max_model_len past the model's trained positions",
    )
    tp_load_timeout_s: float = _var(
        "PAGEDLLM_TP_LOAD_TIMEOUT_S",
        600.0,
        float,
        "python",
        "seconds tensor-parallel workers may take to load the model",
    )
    tp_timeout_s: float = _var(
        "PAGEDLLM_TP_TIMEOUT_S", 60.0, float, "python", "seconds a tensor-parallel collective may wait"
    )
    pp_timeout_s: float = _var(
        "PAGEDLLM_PP_TIMEOUT_S",
        20.0,
        float,
        "python",
        "seconds one pipeline stage-to-stage send or receive may wait for its peer",
    )
    api_key: str | None = _var(
        "PAGEDLLM_API_KEY", None, str, "python", "the server's API key when --api-key is not given"
    )
    fleet_log_dir: str | None = _var(
        "PAGEDLLM_FLEET_LOG_DIR",
        None,
        str,
        "python",
        "where serve --data-parallel-size writes each replica's and the "
        "gateway's log (default: a new temporary folder)",
    )

    @classmethod
    def from_env(cls, environ: Any = None) -> "Settings":
        """Every variable as `environ` (default: os.environ) says now."""
        env = os.environ if environ is None else environ
        return cls(**{f.name: _parse(f.name, env.get(f.metadata["env"])) for f in fields(cls)})


_FIELDS = {f.name: f for f in fields(Settings)}


def env_name(name: str) -> str:
    """The variable of setting `name` ("tp_timeout_s" -> "PAGEDLLM_TP_TIMEOUT_S")."""
    return _FIELDS[name].metadata["env"]


def choices(name: str) -> tuple[str, ...]:
    """The values setting `name` may take (its one definition)."""
    return _FIELDS[name].metadata["choices"]


def get(name: str) -> Any:
    """Setting `name` as the environment says now (one variable read; parsed once per value)."""
    return _parse(name, os.environ.get(_FIELDS[name].metadata["env"]))


@lru_cache(maxsize=256)
def _parse(name: str, raw: str | None) -> Any:
    f = _FIELDS[name]
    env, kind, choices = f.metadata["env"], f.metadata["kind"], f.metadata["choices"]
    default = f.default if f.default is not MISSING else None
    if raw is None:
        return default
    text = raw.strip()
    if kind is bool:
        if text.lower() in _OFF:
            return False
        if text.lower() in _ON:
            return True
        return default  # (as before this module: an unknown word leaves the default)
    if kind is int or kind is float:
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"{env}={raw!r} is not {'an integer' if kind is int else 'a number'}") from None
    if choices is not None and raw not in choices:
        raise ValueError(f"{env}={raw!r} is not one of {', '.join(choices)}")
    return raw


def export_for_native() -> None:
    """Write each variable the native library reads (layer "C++") back in the one spelling its
    C++ reader knows ("1"/"0", a plain integer, a level's name), as parsed here: one parser for
    both languages, so `PAGEDLLM_HUGE_PAGES=false` means off to the kernels as it does to Python. A bad
    value is refused here, before the library loads. Unset variables stay unset."""
    for name, f in _FIELDS.items():
        m = f.metadata
        if "C++" not in m["layer"] or os.environ.get(m["env"]) is None:
            continue
        value = get(name)
        os.environ[m["env"]] = ("1" if value else "0") if m["kind"] is bool else str(value)


def table() -> str:
    """The settings as docs/configuration.md's Markdown table."""
    rows = ["| Variable | Type | Default | Read by | What it is for |", "|---|---|---|---|---|"]
    for f in fields(Settings):
        m = f.metadata
        kind = " \\| ".join(m["choices"]) if m["choices"] else m["kind"].__name__
        default = (
            "unset"
            if f.default is None
            else ("1" if f.default is True else "0" if f.default is False else str(f.default))
        )
        rows.append(f"| `{m['env']}` | {kind} | {default} | {m['layer']} | {m['doc']} |")
    return "\n".join(rows) + "\n"
