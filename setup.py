"""Builds pagedllm's native CPU kernels (pagedllm/native/csrc) into pagedllm/native/_kernels*.so
when the package is built, so an install or a wheel carries them and nothing compiles at run time.
Everything else about the package is in pyproject.toml.

The kernels link against torch's C++ library, so they are compiled against the torch that will
run them: the one installed in this environment. pip must therefore build without isolation
(an isolated build would fetch a second torch, ~1 GB or more, for nothing):

    pip install torch==2.13.0          # first, the build you want (CPU, CUDA ...)
    pip install --no-build-isolation -e .     # or: pip wheel --no-build-isolation .

`make kernels` (python setup.py build_ext --inplace) rebuilds them in a checkout after an edit.
PAGEDLLM_BUILD_KERNELS=0 builds the package without them (the PyTorch paths are used).

One build serves every x86-64 CPU: each source is compiled once per instruction-set level
(csrc/isa.h) and csrc/dispatch.cpp registers the best level the CPU runs when the library loads.
"""
from __future__ import annotations

import os
import platform
import sys
import sysconfig
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = Path("pagedllm/native/csrc")
LEVELS = {0: "base", 1: "avx2", 2: "avx512vnni", 3: "avx512bf16"}  # as csrc/isa.h and dispatch.cpp
# The levels each source is compiled at (dispatch.cpp registers from exactly these): prefill
# attention has a kernel only with AVX-512 BF16; the rest is compiled up to AVX-512 VNNI.
SOURCE_LEVELS = {
    "cpu_kernels": (0, 1, 2),
    "decode_stack": (0, 1, 2),
    "quant_kernels": (0, 1, 2),
    "quant_packed": (0, 1, 2),
    "sample_kernels": (0, 1, 2),
    "prefill_attention": (0, 3),
}
# -g0 after Python's own -g: the debug info was stripped at link anyway, and generating it for
# torch's headers was about half of each object's compile time (46.9 s -> 25.1 s CPU for one).
FLAGS = ["-O3", "-g0", "-fopenmp", "-fno-math-errno"]


def _wanted() -> bool:
    return os.environ.get("PAGEDLLM_BUILD_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def _write_if_changed(path: Path, text: str) -> None:
    # An unchanged wrapper keeps its timestamp, so an incremental build recompiles nothing.
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def level_sources() -> list[str]:
    """One two-line wrapper per (source, level) under build/, each compiled to its own object,
    plus the dispatch; paths relative to the project root, as setuptools wants them."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    out = Path("build/pagedllm_levels")
    (ROOT / out).mkdir(parents=True, exist_ok=True)
    sources = []
    for name, levels in SOURCE_LEVELS.items():
        for level in levels if x86 else (0,):
            wrapper = out / f"{name}_{LEVELS[level]}.cpp"
            _write_if_changed(ROOT / wrapper, f'#define PAGEDLLM_LEVEL {level}\n'
                                              f'#include "{(ROOT / CSRC / name).as_posix()}.cpp"\n')
            sources.append(wrapper.as_posix())
    sources.append((CSRC / "dispatch.cpp").as_posix())
    sources.append((CSRC / "weight_memory.cpp").as_posix())  # (no SIMD: one copy)
    return sources


def ext_modules_and_cmdclass() -> tuple[list, dict]:
    if not _wanted():
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        sys.exit(
            "pagedllm: building the native kernels needs the torch they will run with, and none is "
            "importable here. Install torch first, then build without pip's isolated environment "
            "(which would fetch another torch): `pip install --no-build-isolation .` "
            "(or `pip wheel --no-build-isolation .`; `make setup` does both). "
            "PAGEDLLM_BUILD_KERNELS=0 builds the package without kernels (slower PyTorch paths).")
    class BuildKernels(BuildExtension):
        """torch's build (ninja, in parallel, only what changed), with its objects kept under
        build/ whichever command runs it: an editable install would compile them all in a
        temporary folder and throw them away."""

        def run(self) -> None:
            self.build_temp = str(ROOT / "build" / f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")
            super().run()

    ext = CppExtension(
        name="pagedllm.native._kernels",
        sources=level_sources(),
        depends=[p.as_posix() for p in sorted(CSRC.iterdir())],  # an edit anywhere rebuilds
        include_dirs=[str(ROOT / CSRC)],
        extra_compile_args={"cxx": FLAGS},
        # Nothing to strip since -g0; kept for a compiler that still emits some.
        extra_link_args=["-fopenmp", "-Wl,--strip-debug"],
    )
    return [ext], {"build_ext": BuildKernels}


ext_modules, cmdclass = ext_modules_and_cmdclass()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
