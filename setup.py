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

Each source is compiled once per instruction-set level (csrc/isa.h) and csrc/dispatch.cpp
registers the best compiled level the CPU runs when the library loads. A build for this machine
(the default) compiles the baseline level, the best level this CPU's flags allow and the
avxvnni level's build this CPU runs (the VEX one, or on a CPU with AVX-512 VNNI but no AVX-VNNI
its EVEX twin, so that the level's code is tested there by capping), nothing else;
PAGEDLLM_ISA_LEVELS=all (`make wheel`) compiles every level, both builds of avxvnni, so one
wheel serves every x86-64 CPU. The compile says what it does, a line per object, on stderr.
"""

from __future__ import annotations

import os
import platform
import sys
import sysconfig
import threading
import time
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = Path("pagedllm/native/csrc")
LEVELS = {0: "base", 1: "avx2", 2: "avxvnni", 3: "avx512vnni", 4: "avx512bf16"}  # as csrc/isa.h and dispatch.cpp
AVXVNNI = 2
# The avxvnni level's two builds of one source (csrc/isa.h): VEX (AVX-VNNI) and the EVEX twin
# (AVX-512 VL + VNNI), each an object set of its own. A build is named by its level, the twin so.
TWIN = "avxvnni_evex"
BUILDS = [*LEVELS.values()][: AVXVNNI + 1] + [TWIN] + [*LEVELS.values()][AVXVNNI + 1 :]
BUILD_LEVEL = {**{v: k for k, v in LEVELS.items()}, TWIN: AVXVNNI}
# The levels each source is compiled at (dispatch.cpp registers from exactly these): prefill
# attention has a kernel only with AVX-512 BF16; the int8 products (quant_*, and decode_stack,
# which calls them in its own level) also at avxvnni; the rest is compiled up to AVX-512 VNNI.
# At a level a source lacks, its highest level below is registered.
SOURCE_LEVELS = {
    "cpu_kernels": (0, 1, 3),
    "decode_stack": (0, 1, 2, 3),
    "quant_kernels": (0, 1, 2, 3),
    "quant_packed": (0, 1, 2, 3),
    "sample_kernels": (0, 1, 3),
    "prefill_attention": (0, 4),
}
# The CPU flags (/proc/cpuinfo) each build's instructions need, as dispatch.cpp's cpu_runs().
_AVX2_FLAGS = {"avx2", "fma", "f16c"}
_AVX512_FLAGS = _AVX2_FLAGS | {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"}
BUILD_FLAGS = {
    "base": set(),
    "avx2": _AVX2_FLAGS,
    "avxvnni": _AVX2_FLAGS | {"avx_vnni"},
    TWIN: _AVX2_FLAGS | {"avx512f", "avx512vl", "avx512_vnni"},
    "avx512vnni": _AVX512_FLAGS,
    "avx512bf16": _AVX512_FLAGS | {"avx512_bf16"},
}
# -g0 after Python's own -g: the debug info was stripped at link anyway, and generating it for
# torch's headers was about half of each object's compile time (46.9 s -> 25.1 s CPU for one).
FLAGS = ["-O3", "-g0", "-fopenmp", "-fno-math-errno"]


def host_builds() -> set[str] | None:
    """The builds (BUILDS) whose instructions this CPU has, from /proc/cpuinfo's flags as
    dispatch.cpp's cpu_runs() reads them; None where the flags cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())
    return {b for b in BUILDS if BUILD_FLAGS[b] <= flags}


def wanted_levels() -> set[str]:
    """The builds (BUILDS) to compile: PAGEDLLM_ISA_LEVELS=all every one; =native (the default)
    the baseline, the best this CPU runs and the avxvnni build it runs (VEX, else the twin); or
    a comma list of names (base,avx2,avxvnni_evex)."""
    spec = os.environ.get("PAGEDLLM_ISA_LEVELS", "native").strip().lower() or "native"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return {"base"}
    if spec == "all":
        return set(BUILDS)
    if spec == "native":
        runs = host_builds()
        if runs is None:  # (no /proc/cpuinfo: not Linux) every level, as a wheel
            return set(BUILDS)
        best = max((b for b in runs if b != TWIN), key=BUILD_LEVEL.__getitem__)
        vnni = ["avxvnni"] if "avxvnni" in runs else [TWIN] if TWIN in runs else []
        return {"base", best, *vnni}
    bad = [n for n in spec.split(",") if n.strip() not in BUILDS]
    if bad:
        sys.exit(f"pagedllm: PAGEDLLM_ISA_LEVELS={spec!r}: {bad} not among all, native, {', '.join(BUILDS)}")
    return {"base"} | {n.strip() for n in spec.split(",")}


def source_build(name: str, build: str) -> str:
    """The build of source `name` that dispatch.cpp registers at `build`'s level: that build, or
    where the source is not compiled at that level, its highest level below."""
    level = BUILD_LEVEL[build]
    if level in SOURCE_LEVELS[name]:
        return build
    return LEVELS[max(lv for lv in SOURCE_LEVELS[name] if lv < level)]


def _wanted() -> bool:
    return os.environ.get("PAGEDLLM_BUILD_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def _write_if_changed(path: Path, text: str) -> None:
    # An unchanged wrapper keeps its timestamp, so an incremental build recompiles nothing.
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def level_sources() -> list[str]:
    """One two-line wrapper per (source, level) under build/, each compiled to its own object,
    plus the dispatch; paths relative to the project root, as setuptools wants them."""
    wanted = wanted_levels()
    out = Path("build/pagedllm_levels")
    (ROOT / out).mkdir(parents=True, exist_ok=True)
    sources = []
    # Each wanted build's objects: per source, the one dispatch.cpp registers at that level.
    built = {name: {source_build(name, b) for b in wanted} for name in SOURCE_LEVELS}
    for name in SOURCE_LEVELS:
        for build in sorted(built[name], key=BUILDS.index):
            wrapper = out / f"{name}_{build}.cpp"
            twin = "#define PAGEDLLM_EVEX_TWIN 1\n" if build == TWIN else ""
            _write_if_changed(
                ROOT / wrapper,
                f"#define PAGEDLLM_LEVEL {BUILD_LEVEL[build]}\n{twin}"
                f'#include "{(ROOT / CSRC / name).as_posix()}.cpp"\n',
            )
            sources.append(wrapper.as_posix())
    # What dispatch.cpp may register: a level's build is there when every source's object for it is.
    have = {b: all(source_build(n, b) in built[n] for n in SOURCE_LEVELS) for b in BUILDS[1:]}
    _write_if_changed(
        ROOT / out / "pagedllm_built_levels.h",
        "// Written by setup.py: the instruction-set levels this build compiled.\n"
        + "".join(f"#define PAGEDLLM_BUILT_{b.upper()} {int(have[b])}\n" for b in BUILDS[1:]),
    )
    sources.append((CSRC / "dispatch.cpp").as_posix())
    sources.append((CSRC / "weight_memory.cpp").as_posix())  # (no SIMD: one copy)
    sources.append((CSRC / "tuning.cpp").as_posix())
    return sources


class _Progress:
    """Says which objects will compile, then a line as each one is done, and one at least every
    8 s while the compiler runs, so a build is never a silent terminal."""

    def __init__(self, sources: list[str], objects: list[str], depends: list[str]) -> None:
        newest = max((ROOT / p).stat().st_mtime for p in [*sources, *depends] if (ROOT / p).exists())
        self.todo = [
            (s, o) for s, o in zip(sources, objects) if not Path(o).exists() or Path(o).stat().st_mtime < newest
        ]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    @staticmethod
    def _say(text: str) -> None:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    @staticmethod
    def _name(source: str) -> str:
        stem = Path(source).stem  # cpu_kernels_avx2 -> "cpu_kernels.cpp avx2"
        for level in sorted(BUILDS, key=len, reverse=True):
            if stem.endswith("_" + level):
                return f"{stem[: -len(level) - 1]}.cpp {level}"
        return Path(source).name

    def __enter__(self) -> "_Progress":
        self.start, self.wall_start = time.monotonic(), time.time() - 1
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        if self.todo:
            self._say(
                f"pagedllm: compiling {len(self.todo)} native kernel objects, {jobs} at a time "
                f"(levels {', '.join(sorted(wanted_levels(), key=BUILDS.index))}; "
                f"ninja's log: build/kernels-build.log)"
            )
        else:
            self._say("pagedllm: native kernels up to date, nothing to compile")
        self.thread.start()
        return self

    def _watch(self) -> None:
        done: set[str] = set()
        last = time.monotonic()
        while not self.stop.wait(1.0):
            now = time.monotonic()
            for src, obj in self.todo:
                p = Path(obj)
                if src not in done and p.exists() and p.stat().st_mtime >= self.wall_start:
                    done.add(src)
                    self._say(f"[{len(done)}/{len(self.todo)}] {self._name(src)}, {now - self.start:.0f} s")
                    last = now
            if now - last >= 8:
                left = len(self.todo) - len(done)
                self._say(
                    f"  ... {'compiling, ' + str(left) + ' objects to go' if left else 'linking'}, "
                    f"{now - self.start:.0f} s"
                )
                last = now

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        if self.todo and exc[0] is None:
            self._say(f"pagedllm: native kernels built in {time.monotonic() - self.start:.0f} s")


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
            "PAGEDLLM_BUILD_KERNELS=0 builds the package without kernels (slower PyTorch paths)."
        )

    class BuildKernels(BuildExtension):
        """torch's build (ninja, in parallel, only what changed), with its objects kept under
        build/ whichever command runs it: an editable install would compile them all in a
        temporary folder and throw them away."""

        def run(self) -> None:
            self.build_temp = str(ROOT / "build" / f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")
            super().run()

        def build_extension(self, ext) -> None:
            # ninja's own output (a compiler command line per object) goes to a log; a line per
            # object compiled, and one every few seconds while none finishes, to stderr.
            log = ROOT / "build" / "kernels-build.log"
            objects = self.compiler.object_filenames(ext.sources, output_dir=self.build_temp)
            with open(log, "w") as f, _Progress(ext.sources, objects, ext.depends):
                saved = os.dup(1)
                os.dup2(f.fileno(), 1)
                try:
                    super().build_extension(ext)
                except BaseException:
                    os.dup2(saved, 1)
                    sys.stderr.write(log.read_text()[-8000:])
                    raise
                finally:
                    os.dup2(saved, 1)
                    os.close(saved)

    ext = CppExtension(
        name="pagedllm.native._kernels",
        sources=level_sources(),
        depends=[p.as_posix() for p in sorted(CSRC.iterdir())],  # an edit anywhere rebuilds
        include_dirs=[str(ROOT / CSRC), str(ROOT / "build" / "pagedllm_levels")],
        extra_compile_args={"cxx": FLAGS},
        # Nothing to strip since -g0; kept for a compiler that still emits some.
        extra_link_args=["-fopenmp", "-Wl,--strip-debug"],
    )
    return [ext], {"build_ext": BuildKernels}


ext_modules, cmdclass = ext_modules_and_cmdclass()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
