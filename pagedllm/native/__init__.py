"""Native CPU kernels, compiled when the package is built (setup.py) into
`pagedllm/native/_kernels*.so` and registered as torch ops (`torch.ops.pagedllm.*`, visible to
torch.profiler): paged decode attention that reads K/V in place (attention/paged.py), a bf16
matrix-vector product for decode at batch 1-2 (models/linear.py), products with GGUF-quantized
weights (quant/, models/linear.py), the sampler's top-k (sampling/) and bf16 prefill attention.

Nothing compiles at import: the library is found next to this file and loaded, or, where it is
missing or does not load (not built, built against another torch), one INFO line says so and
how to build it (`make kernels`), and the PyTorch paths run. One build serves every x86-64 CPU:
the library holds each kernel at several instruction-set levels and registers the best this
CPU runs (csrc/isa.h, csrc/dispatch.cpp). `PAGEDLLM_NATIVE=0` turns the kernels off;
`PAGEDLLM_NATIVE_ISA` caps the level (base, avx2, avxvnni, avx512vnni, avx512bf16).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path

from .. import settings, tuning

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
LEVELS = settings.choices("native_isa")  # as csrc/dispatch.cpp
BUILD_HINT = "build them with `make kernels` in a checkout, or reinstall with `pip install --no-build-isolation .`"
# The op set this code calls, as csrc/dispatch.cpp stamps it (NATIVE_ABI there; both bumped
# together whenever an op or class is added, removed or changes its schema). A library with
# another stamp, or none, is refused whole: callers then need only ask whether it loaded.
NATIVE_ABI = 3
REBUILD_HINT = "rebuild with `make kernels` or `pip install --no-build-isolation -e .`"


def disabled_reason() -> str | None:
    if not settings.get("native"):
        return "PAGEDLLM_NATIVE=0"
    return None


def library_path() -> Path | None:
    """The compiled kernels next to this file (`_kernels.<python tag>.so`), or None."""
    found = sorted(HERE.glob("_kernels*.so")) + sorted(HERE.glob("_kernels*.pyd"))
    return found[0] if found else None


@lru_cache(maxsize=1)
def cpu_kernels():
    """The op namespace `torch.ops.pagedllm` (`paged_decode`, `linear_small_m`, `quant_*`), or
    None where the kernels are off, not built, or do not load."""
    tuning.warn_retired()
    why = disabled_reason()
    if why:
        logger.info("native CPU kernels off (%s): the PyTorch paths are used", why)
        return None
    settings.export_for_native()  # the C++ side reads these variables in Python's spelling
    import torch

    lib = library_path()
    if lib is None:
        logger.info(
            "native CPU kernels not built (no _kernels*.so in %s): the PyTorch paths are used; %s", HERE, BUILD_HINT
        )
        return None
    try:
        torch.ops.load_library(str(lib))
        ops = torch.ops.pagedllm
        built_for = str(ops.native_torch_version())
        stamp = int(ops.native_abi()) if hasattr(ops, "native_abi") else None
    except (OSError, RuntimeError, AttributeError) as e:
        last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        logger.info("native CPU kernels in %s do not load (%s): the PyTorch paths are used; %s", lib, last, BUILD_HINT)
        return None
    running = torch.__version__.split("+")[0]
    if built_for.split(".")[:2] != running.split(".")[:2]:
        # Loaded but compiled against another torch's C++ ABI: calling them could crash.
        logger.info(
            "native CPU kernels in %s were built for torch %s, this is torch %s: the PyTorch paths are used; %s",
            lib,
            built_for,
            running,
            BUILD_HINT,
        )
        return None
    if stamp != NATIVE_ABI:
        logger.warning(
            "native CPU kernels in %s are a stale build (op set %s, this code calls op set %d): "
            "the PyTorch paths are used; %s",
            lib,
            "unstamped" if stamp is None else stamp,
            NATIVE_ABI,
            REBUILD_HINT,
        )
        return None
    logger.debug("native CPU kernels loaded from %s (%s level)", lib, ops.native_isa())
    tuning.on_change(lambda t: ops.set_tuning(*tuning.native_values(t)))
    _warn_unbuilt_cap(ops)
    return ops


def _warn_unbuilt_cap(ops) -> None:
    """A PAGEDLLM_NATIVE_ISA cap naming a level this library was not compiled at runs a lower one
    (a build for one machine holds only the baseline and the host's best level): say so, since
    whoever set the cap meant to run that level."""
    cap = settings.get("native_isa")
    built = str(ops.native_built_levels()).split(",")
    if cap is not None and cap not in built_levels(ops) and cap != level_of(str(ops.native_isa())):
        logger.warning(
            "PAGEDLLM_NATIVE_ISA=%s: these kernels were compiled at %s only, so they run at %s; "
            "rebuild with PAGEDLLM_ISA_LEVELS=all to run %s",
            cap,
            ", ".join(built),
            ops.native_isa(),
            cap,
        )


def level_of(name: str) -> str:
    """The level (LEVELS) of a build's name as native_isa() and native_built_levels() give it:
    "avxvnni (EVEX twin)", the avxvnni level's EVEX build, is avxvnni."""
    return name.split(" ", 1)[0]


def built_levels(ops) -> list[str]:
    """The levels (LEVELS) these kernels were compiled at, in order, whichever build of each."""
    return list(dict.fromkeys(level_of(b) for b in str(ops.native_built_levels()).split(",")))


def release_omp_threads() -> None:
    """Let the calling thread's OpenMP worker threads go (a later parallel region of this thread
    makes new ones).

    libgomp, torch's OpenMP on Linux, counts the workers of every thread that ever ran a
    parallel region, and once they outnumber the CPUs its idle workers sleep instead of
    spinning, so each parallel region pays a wake-up. The decode stack opens about 150 a step,
    so a model loaded on one thread and run on another (the server's engine thread, a user's
    worker thread) decoded far slower than on the loading thread (docs/benchmarks/from-code.md,
    "OpenMP workers on a second thread").
    The thread that loads a model calls this when it is done, and a thread whose engine has
    gone idle. Only GNU libgomp is asked (LLVM's libomp would pause the whole runtime, other
    threads' parallel regions too); elsewhere this does nothing."""
    ops = cpu_kernels()
    if ops is not None and int(ops.release_omp_threads()) != 0:
        logger.debug("this OpenMP runtime does not release one thread's workers: left as they are")


def main() -> int:
    """`python -m pagedllm.native`: say whether the kernels load here, and at which level."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ops = cpu_kernels()
    if ops is None:
        print("native CPU kernels: not available, PyTorch paths used")
        return 1
    print(f"native CPU kernels: {library_path()} ({ops.native_isa()} level)")
    return 0
