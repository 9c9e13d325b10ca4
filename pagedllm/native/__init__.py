"""Native CPU kernels, built on first use with torch.utils.cpp_extension and cached, and
registered as torch ops (`torch.ops.pagedllm.*`, visible to torch.profiler):
paged decode attention that reads K/V in place (attention/paged.py), a bf16
matrix-vector product for decode at batch 1-2 (models/linear.py), and products with
GGUF-quantized weights (quant/, models/linear.py).

The build needs a C++ compiler and ninja; it is compiled for this machine's CPU
(-march=native), so the cache key carries the CPU's instruction-set flags and a
shared home directory never hands one CPU's build to another. Where the build
fails, the engine logs why once and keeps the PyTorch path: nothing requires it.
`PAGEDLLM_NATIVE=0` turns it off.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]


def _cpu_key() -> str:
    """Hash of the CPU's feature flags: a -march=native build is valid only where they match."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    return hashlib.sha1((platform.machine() + flags).encode()).hexdigest()[:10]


def disabled_reason() -> str | None:
    if os.environ.get("PAGEDLLM_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return "PAGEDLLM_NATIVE=0"
    return None


@lru_cache(maxsize=1)
def cpu_kernels():
    """The op namespace `torch.ops.pagedllm` (`paged_decode`, `linear_small_m`, `quant_*`), or
    None where the kernels cannot be built."""
    why = disabled_reason()
    if why:
        logger.info("native CPU kernels off (%s): the PyTorch paths are used", why)
        return None
    try:
        import torch
        from torch.utils.cpp_extension import _get_build_directory, load

        # The cache key covers every source file and the flags, so any edit rebuilds, and the
        # checkout's path: torch's build folder records its sources' paths, so two checkouts
        # sharing one folder would rebuild each other's kernels on every start.
        digest = hashlib.sha1(" ".join(FLAGS).encode() + str(SOURCES[0].parent.resolve()).encode())
        for src in SOURCES + HEADERS:
            digest.update(src.name.encode() + src.read_bytes())
        name = f"pagedllm_cpu_{_cpu_key()}_{digest.hexdigest()[:10]}"
        built = Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
        if built.is_file():
            logger.debug("loading the native CPU kernels (%s)", name)
        else:
            logger.info("building the native CPU kernels (%s); this takes about a minute, once", name)
        load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
        return torch.ops.pagedllm
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path still works
        logger.warning("native CPU kernels unavailable (%s: %s); using the PyTorch paths",
                       type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None


def main() -> int:
    """`python -m pagedllm.native`: build (or find) the kernels ahead of first use."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mod = cpu_kernels()
    print("native CPU kernels: " + ("ready" if mod is not None else "not available, PyTorch paths used"))
    return 0
