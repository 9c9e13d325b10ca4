"""`pagedllm env` (alias `collect-env`): the report a bug needs, as vLLM's collect_env and
torch.utils.collect_env print theirs: versions, the commit, the machine, the level the native
kernels dispatched to and why, whether they loaded (and how to rebuild them where they did not),
threads, memory, accelerators and the PAGEDLLM_* variables that are set."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

# The CPU flags each native level needs, in the levels' order (dispatch.cpp's cpu_runs()). Not
# nested: a Zen 4 has AVX-512 VNNI but no AVX-VNNI (it runs the avxvnni level's EVEX twin when
# capped there, which dispatch.cpp names "avxvnni (EVEX twin)").
_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = (*_AVX2, "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni")
LEVEL_FLAGS = {
    "avx2": _AVX2,
    "avxvnni": (*_AVX2, "avx_vnni"),
    "avx512vnni": _AVX512,
    "avx512bf16": (*_AVX512, "avx512_bf16"),
}
NOTABLE_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512cd",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def cpu_info() -> dict[str, Any]:
    """The CPU's model name and flags from /proc/cpuinfo (empty where there is none)."""
    name, flags = platform.processor() or "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"model": name, "flags": sorted(flags)}


def cpu_level(flags: set[str], cap: str | None = None) -> str | None:
    """The highest native level these flags run, as dispatch.cpp decides uncapped (avxvnni only
    when the cap names it: dispatch.cpp says why); None if unknown."""
    if not flags:
        return None
    level = "base"
    for name, needed in LEVEL_FLAGS.items():
        if set(needed) <= flags and (name != "avxvnni" or cap == "avxvnni"):
            level = name
    return level


def git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        r = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None


def memory() -> dict[str, float | None]:
    got: dict[str, float | None] = {"total_gb": None, "available_gb": None}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                got["total_gb" if key == "MemTotal" else "available_gb"] = round(int(value.split()[0]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return got


def native_report(cpu_flags: set[str]) -> dict[str, Any]:
    """Whether the native kernels loaded, from where, the level they dispatched to and why."""
    from ..native import BUILD_HINT, cpu_kernels, level_of, library_path

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    log = logging.getLogger("pagedllm.native")
    handler, level, propagate = Keep(), log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False  # kept for the report, not printed twice
    try:
        ops = cpu_kernels()
    except ValueError as e:  # a bad PAGEDLLM_NATIVE_ISA
        ops, said = None, [str(e)]
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
    lib = library_path()
    out: dict[str, Any] = {"loaded": ops is not None, "library": str(lib) if lib else None}
    if ops is None:
        out["why_not"] = said[-1] if said else "unknown"
        out["rebuild"] = BUILD_HINT
        return out
    from .. import settings

    cap = os.environ.get(settings.env_name("native_isa"))  # raw: a bad value is reported, not raised
    host = cpu_level(cpu_flags, cap)
    built = str(ops.native_built_levels()).split(",") if hasattr(ops, "native_built_levels") else None
    level = str(ops.native_isa())
    reasons = [f"this CPU runs up to {host}" if host else "this CPU's flags are unknown"]
    if cap:
        reasons.append(f"capped at {cap} by PAGEDLLM_NATIVE_ISA")
    if built is not None and host and _rank(level_of(level)) < min(_rank(host), _rank(cap) if cap else 99):
        reasons.append(f"this build compiled only {', '.join(built)} (PAGEDLLM_ISA_LEVELS=all compiles every level)")
    out.update(level=level, why="; ".join(reasons), built_levels=built)
    from ..quant.kernels import kernel_path

    out["quant_path"], out["quant_why"] = kernel_path()
    return out


def _rank(level: str) -> int:
    return ("base", *LEVEL_FLAGS).index(level) if level in ("base", *LEVEL_FLAGS) else -1


def accelerators(torch: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "cuda_version": torch.version.cuda}
    if out["cuda_available"]:
        out["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    out["mps_available"] = bool(mps is not None and mps.is_available())
    return out


def collect() -> dict[str, Any]:
    import torch

    from .. import __version__

    cpu = cpu_info()
    flags = set(cpu["flags"])
    env = {
        k: ("(set, not shown)" if any(w in k for w in SECRET_WORDS) else v)
        for k, v in sorted(os.environ.items())
        if k.startswith("PAGEDLLM_")
    }
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "pagedllm": __version__,
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "os": platform.platform(),
        "cpu": {
            "model": cpu["model"],
            "machine": platform.machine(),
            "flags": [f for f in NOTABLE_FLAGS if f in flags],
            "level": cpu_level(flags),
        },
        "native": native_report(flags),
        "threads": {
            "torch": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "usable_cpus": affinity,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        },
        "memory": memory(),
        "accelerators": accelerators(torch),
        "env": env,
    }


def format_report(r: dict[str, Any]) -> str:
    n, t, m, a = r["native"], r["threads"], r["memory"], r["accelerators"]
    lines = [
        f"pagedllm:        {r['pagedllm']} (commit {r['git_commit'] or 'unknown: not a git checkout'})",
        f"torch:           {r['torch']}",
        f"python:          {r['python']}",
        f"os:              {r['os']}",
        f"cpu:             {r['cpu']['model'] or 'unknown'} ({r['cpu']['machine']})",
        f"cpu flags:       {' '.join(r['cpu']['flags']) or 'none of note'}",
    ]
    if n["loaded"]:
        lines += [
            f"native kernels:  loaded from {n['library']}",
            f"native level:    {n['level']}: {n['why']}"
            + (f"; compiled: {', '.join(n['built_levels'])}" if n.get("built_levels") else ""),
            f"quantized path:  {n['quant_path'] or 'dequantized at load'} ({n['quant_why']})",
        ]
    else:
        lines += [
            f"native kernels:  NOT loaded ({n['why_not']}); the PyTorch paths run",
            f"                 to rebuild: {n['rebuild']}",
        ]
    lines += [
        f"threads:         torch {t['torch']}, CPUs {t['cpus']} ({t['usable_cpus']} usable), "
        f"OMP_NUM_THREADS={t['OMP_NUM_THREADS'] or 'unset'}",
        f"memory:          {m['total_gb']} GB total, {m['available_gb']} GB available",
        "cuda:            "
        + (
            f"{', '.join(a['cuda_devices'])} (CUDA {a['cuda_version']})"
            if a["cuda_available"]
            else "not available"
            + (f" (torch built for CUDA {a['cuda_version']})" if a["cuda_version"] else " (a CPU build of torch)")
        ),
        f"mps:             {'available' if a['mps_available'] else 'not available'}",
        "PAGEDLLM_* set:  " + (" ".join(f"{k}={v}" for k, v in r["env"].items()) or "none"),
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
