"""The native kernels as built at install (setup.py): one library for every x86-64 CPU, whose
instructions match the level each function was compiled for, that runs its baseline objects on
any machine, and that a wheel carries to a machine with no compiler."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from pagedllm.native import disabled_reason, library_path

ROOT = Path(__file__).resolve().parent.parent
ENV = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_")}

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = [pytest.mark.slow, pytest.mark.skipif(disabled_reason() is not None, reason="native kernels turned off")]


def _library() -> Path:
    lib = library_path()
    assert lib is not None, "pagedllm/native/_kernels*.so is not built: `make kernels`"
    return lib


# x86-64 opcode bytes that may come before a VEX (C4, C5) or EVEX (62) prefix; in 64-bit mode
# those three bytes are never anything else.
_SKIPPABLE = {"67", "26", "2e", "36", "3e", "64", "65"}


def _encodings(lib: Path) -> dict[str, set[str]]:
    """Per function of the library, the encodings its instructions use: "vex", "evex"; and
    "vpdpbusd:vex" / "vpdpbusd:evex" where it holds that instruction, "evex:other" where it holds
    another EVEX one, "zmm" where it names a 512-bit register."""
    out = subprocess.run(
        ["objdump", "-d", "-C", "--no-addresses", "--insn-width=16", str(lib)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found: dict[str, set[str]] = {}
    name = ""
    for line in out.splitlines():
        m = re.match(r"^<(.*)>:$", line)
        if m:
            name = m.group(1)
            found.setdefault(name, set())
            continue
        parts = line.split("\t")  # "", the bytes, the instruction
        if len(parts) < 3 or not name:
            continue
        code = [b for b in parts[1].split() if re.fullmatch(r"[0-9a-f]{2}", b)]
        while code and code[0] in _SKIPPABLE:
            code = code[1:]
        enc = "vex" if code and code[0] in ("c4", "c5") else "evex" if code and code[0] == "62" else None
        if enc:
            found[name].add(enc)
            if "vpdpbusd" in parts[2]:
                found[name].add(f"vpdpbusd:{enc}")
            elif enc == "evex":
                found[name].add("evex:other")
        if "%zmm" in parts[2]:
            found[name].add("zmm")
    return found


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
@pytest.mark.skipif(sysconfig.get_platform() != "linux-x86_64", reason="x86-64 instruction sets")
def test_every_instruction_is_of_its_functions_level():
    """No AVX outside the AVX2, avxvnni and AVX-512 levels' code, no AVX-512 (EVEX) outside the
    AVX-512 levels' and the avxvnni level's EVEX twin: in particular none in the library code
    (std::, at::) the linker keeps one copy of. The avxvnni level's VEX build holds VEX only,
    vpdpbusd among it (no CPU here may run it: its instructions are all that is checked of it),
    and its EVEX twin the same code with EVEX vpdpbusd, no other EVEX instruction, no zmm register. Each level the build
    compiled is there (a build for this machine: the baseline, this CPU's best and the avxvnni
    build it runs; `PAGEDLLM_ISA_LEVELS=all`: every one, checked on the wheel below)."""
    _check_levels(_library(), _built_levels())


def _built_levels() -> list[str]:
    from pagedllm.native import cpu_kernels

    ops = cpu_kernels()
    assert ops is not None and hasattr(ops, "native_built_levels"), "the kernels do not load: `make kernels`"
    return str(ops.native_built_levels()).split(",")


def _check_levels(lib: Path, built: list[str]) -> None:
    enc = _encodings(lib)
    spaces = {
        "avx2": "isa_avx2::",
        "avxvnni": "isa_avxvnni::",
        "avxvnni (EVEX twin)": "isa_avxvnni_evex::",
        "avx512vnni": "isa_avx512vnni::",
        "avx512bf16": "isa_avx512bf16::",
    }
    assert built[0] == "base" and any("isa_base::" in n for n in enc), built
    for level, space in spaces.items():
        if level == "avx2" and any(b.startswith("avxvnni") for b in built):
            continue  # (the avxvnni level registers AVX2 objects of the sources it does not compile)
        assert any(space in n for n in enc) == (level in built), f"{level}: compiled {built}"
    if "avx512bf16" in built:
        assert any("evex" in e for n, e in enc.items() if "isa_avx512bf16::" in n)
    vex_build = {n: e for n, e in enc.items() if "isa_avxvnni::" in n}
    twin = {n: e for n, e in enc.items() if "isa_avxvnni_evex::" in n}
    if "avxvnni" in built:
        assert any("vpdpbusd:vex" in e for e in vex_build.values()), "no VEX vpdpbusd in the avxvnni objects"
    if "avxvnni (EVEX twin)" in built:
        assert any("vpdpbusd:evex" in e for e in twin.values()), "no EVEX vpdpbusd in the avxvnni twin"
    wide = sorted(n for n, e in twin.items() if "zmm" in e or "evex:other" in e)
    assert not wide, f"{len(wide)} functions of the avxvnni twin hold zmm or EVEX beyond vpdpbusd: {wide[:10]}"
    wrong = sorted(
        n
        for n, e in enc.items()
        if ("evex" in e and "isa_avx512" not in n and "isa_avxvnni_evex::" not in n)
        or ("vex" in e and not any(s in n for s in ("isa_avx2::", "isa_avxvnni", "isa_avx512")))
    )
    assert not wrong, f"{len(wrong)} functions hold instructions above their level: {wrong[:10]}"


_OPS_CHECK = r"""
import torch, torch.nn.functional as F
from pagedllm.native import cpu_kernels
from pagedllm.quant.kernels import available_isas
ops = cpu_kernels()
print(ops.native_isa(), ",".join(available_isas()))
torch.manual_seed(0)
# paged decode against gather + SDPA
n, hq, hkv, d, bs, nb = 3, 4, 2, 64, 16, 12
q = torch.randn(n, hq, d)
kc, vc = torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d)
tables = torch.randperm(nb)[: n * 4].view(n, 4).long()
lens = torch.tensor([5, 33, 64])
out = ops.paged_decode(q, kc, vc, tables, lens, d ** -0.5, 0)
for i in range(n):
    k = kc[tables[i]].flatten(0, 1)[: lens[i]].transpose(0, 1).repeat_interleave(hq // hkv, 0)
    v = vc[tables[i]].flatten(0, 1)[: lens[i]].transpose(0, 1).repeat_interleave(hq // hkv, 0)
    ref = F.scaled_dot_product_attention(q[i][:, None], k, v, scale=d ** -0.5)[:, 0]
    torch.testing.assert_close(out[i], ref, rtol=1e-4, atol=1e-4)
# a Q8_0 matmul on the scalar path against the dequantized weight
import numpy as np
from gguf import GGMLQuantizationType, quantize, dequantize
w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
raw = quantize(w, GGMLQuantizationType.Q8_0)
x = torch.randn(2, 64)
y = ops.quant_matmul(x, [torch.from_numpy(raw)], [int(GGMLQuantizationType.Q8_0)], 64, 1)
ref = x @ torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0)).T
torch.testing.assert_close(y, ref, rtol=0, atol=0.05 * ref.abs().max().item())  # int8 activations
print("ok")
print(" ".join(f"{v:.6f}" for v in y.flatten().tolist()))
"""


def test_baseline_level_runs_here():
    """PAGEDLLM_NATIVE_ISA=base registers the baseline objects (what a CPU without AVX2 runs):
    they load, offer the scalar path only, compute what PyTorch does, and the scalar quantized
    path gives what the same path of this CPU's level gives."""

    def check(**env: str) -> list[str]:
        r = subprocess.run(
            [sys.executable, "-c", _OPS_CHECK],
            capture_output=True,
            text=True,
            timeout=300,
            env={**ENV, **env, "PYTHONPATH": str(ROOT)},
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout.splitlines()

    base = check(PAGEDLLM_NATIVE_ISA="base")
    assert base[:2] == ["base scalar", "ok"], base
    best = check()
    assert best[1] == "ok" and best[0] != base[0], best
    assert [float(v) for v in base[2].split()] == pytest.approx([float(v) for v in best[2].split()], abs=1e-4)


_LEVELS = ["base", "avx2", "avxvnni", "avx512vnni", "avx512bf16"]  # as csrc/dispatch.cpp
_AVX2 = {"avx2", "fma", "f16c"}
_AVX512 = _AVX2 | {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"}
_CAP_CHECK = r"""
import numpy as np, torch
from gguf import GGMLQuantizationType as Q, quantize
from pagedllm.native import cpu_kernels
from pagedllm.quant.formats import QuantTensor
from pagedllm.quant.kernels import available_isas
ops = cpu_kernels()
w = np.random.default_rng(0).standard_normal((32, 256)).astype(np.float32)
qt = QuantTensor("Q4_0", torch.from_numpy(quantize(w, Q.Q4_0)), (32, 256)).pack()
y = ops.quant_matmul(torch.randn(3, 256), [qt.data], [qt.type_id], 256, 0)  # the level's best path
assert torch.isfinite(y).all()
print(ops.native_isa() + "|" + ",".join(available_isas()))
"""


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))


def _expected_level(cap: str, built: list[str], flags: set[str]) -> str:
    """dispatch.cpp's rule: the highest level at or below the cap that the build holds and the
    CPU runs; at avxvnni the VEX build where the CPU has AVX-VNNI, else the EVEX twin on AVX-512 VNNI."""
    vex = "avxvnni" in built and _AVX2 | {"avx_vnni"} <= flags
    twin = "avxvnni (EVEX twin)" in built and _AVX2 | {"avx512f", "avx512vl", "avx512_vnni"} <= flags
    runs = {
        "base": True,
        "avx2": "avx2" in built and _AVX2 <= flags,
        "avxvnni": vex or twin,
        "avx512vnni": "avx512vnni" in built and _AVX512 <= flags,
        "avx512bf16": "avx512bf16" in built and _AVX512 | {"avx512_bf16"} <= flags,
    }
    level = next(lv for lv in reversed(_LEVELS[: _LEVELS.index(cap) + 1]) if runs[lv])
    return "avxvnni (EVEX twin)" if level == "avxvnni" and not vex else level


@pytest.mark.skipif(sysconfig.get_platform() != "linux-x86_64", reason="x86-64 instruction sets")
def test_each_cap_registers_the_best_level_this_cpu_runs_at_or_below_it():
    """PAGEDLLM_NATIVE_ISA=<level>: the highest level at or below it that the build holds and this
    CPU runs (the levels are ordered but not nested: a Zen 4 has AVX-512 VNNI and no AVX-VNNI, so
    capped at avxvnni it runs the EVEX twin, never the VEX objects), whose quantized paths it
    offers, and whose best path computes (a wrong level's instructions would kill it: SIGILL)."""
    built, flags = _built_levels(), _cpu_flags()
    paths = {
        "base": "scalar",
        "avx2": "scalar,avx2",
        "avxvnni": "scalar,avx2,avxvnni",
        "avx512vnni": "scalar,avx2,avx512-vnni",
        "avx512bf16": "scalar,avx2,avx512-vnni",
    }
    seen = {}
    for cap in _LEVELS:
        r = subprocess.run(
            [sys.executable, "-c", _CAP_CHECK],
            capture_output=True,
            text=True,
            timeout=300,
            env={**ENV, "PAGEDLLM_NATIVE_ISA": cap, "PYTHONPATH": str(ROOT)},
        )
        assert r.returncode == 0, f"capped at {cap}: rc {r.returncode}: {r.stderr[-2000:]}"
        level, isas = r.stdout.strip().splitlines()[-1].split("|")
        want = _expected_level(cap, built, flags)
        assert level == want, f"capped at {cap} ({', '.join(built)} built): {level}, not {want}"
        assert isas == paths[level.split(" ")[0]], f"capped at {cap}: {level} offers {isas}"
        seen[cap] = level
    if "avx_vnni" not in flags and _AVX512 <= flags and "avxvnni (EVEX twin)" in built:
        assert seen["avxvnni"] == "avxvnni (EVEX twin)", seen  # (this CPU cannot run the VEX build)


@pytest.mark.skipif(sysconfig.get_platform() != "linux-x86_64", reason="x86-64 instruction sets")
def test_avxvnni_level_gives_the_default_levels_tokens(smollm2_gguf_path):
    """SmolLM2 (Q4_1, packed) greedy at the avxvnni level (the VEX build, or on a CPU without
    AVX-VNNI its EVEX twin) gives the tokens of this CPU's own level, as at avx2."""
    built, flags = _built_levels(), _cpu_flags()
    if _expected_level("avxvnni", built, flags).split(" ")[0] != "avxvnni":
        pytest.skip(f"no build of the avxvnni level this CPU runs (built: {', '.join(built)})")

    def generate(**env: str) -> str:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pagedllm",
                "generate",
                "Name three colors.",
                "-m",
                str(smollm2_gguf_path),
                "--max-tokens",
                "24",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env={**ENV, **env, "PYTHONPATH": str(ROOT)},
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout

    default = generate()
    assert default.strip() and generate(PAGEDLLM_NATIVE_ISA="avxvnni") == default


def test_unknown_level_cap_is_refused():
    r = subprocess.run(
        [sys.executable, "-c", "from pagedllm.native import cpu_kernels; cpu_kernels()"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**ENV, "PAGEDLLM_NATIVE_ISA": "avx3", "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode != 0, r.stderr
    assert "PAGEDLLM_NATIVE_ISA='avx3' is not one of base, avx2, avxvnni, avx512vnni, avx512bf16" in r.stderr, r.stderr


def _venv(path: Path) -> Path:
    """A fresh venv without pip that sees this environment's packages (torch, pip, setuptools)
    after its own, through a .pth file: nothing is downloaded or reinstalled."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    site = Path(
        subprocess.run(
            [str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "_outer_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return path / "bin" / "python"


@pytest.mark.install
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler to build with")
def test_wheel_carries_the_kernels_to_a_machine_without_compiler(tmp_path, smollm2_gguf_path):
    """`pip wheel --no-build-isolation`, the wheel installed in a fresh venv with no compiler
    (nor ninja) on PATH: `pagedllm trace` runs the quantized and attention kernels,
    and forcing the AVX2 path gives the default path's tokens. The wheel is built from this
    checkout, in place, so objects already compiled under build/ are reused (only what changed
    compiles; a clone without them compiles everything, a few minutes)."""
    # Built by this environment's Python: a fresh venv's include folder enters every compile
    # command, so ninja would recompile every object instead of reusing this checkout's.
    # Every level, as `make wheel` builds it: one wheel for every x86-64 CPU.
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-build-isolation",
            "--no-deps",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=3600,
        env={**ENV, "PYTHONPATH": "", "PAGEDLLM_ISA_LEVELS": "all"},
    )
    assert r.returncode == 0, r.stderr[-5000:]
    (wheel,) = (tmp_path / "dist").glob("pagedllm-*.whl")
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert any(re.fullmatch(r"pagedllm/native/_kernels.*\.so", n) for n in names), names
    assert "pagedllm/native/csrc/quant_common.h" in names

    runner = _venv(tmp_path / "run-venv")
    bindir = runner.parent
    r = subprocess.run(
        [str(runner), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**ENV, "PYTHONPATH": ""},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    env = {
        "PATH": str(bindir),
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "HF_HUB_OFFLINE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    for tool in ("gcc", "g++", "cc", "c++", "ninja"):
        assert shutil.which(tool, path=env["PATH"]) is None, tool

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(bindir / "pagedllm"), *args],
            capture_output=True,
            text=True,
            timeout=600,
            env={**env, **extra},
            cwd=tmp_path,
        )

    where = subprocess.run(
        [str(runner), "-c", "import pagedllm.native as n; print(n.library_path())"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert str(tmp_path / "run-venv") in where.stdout, where.stdout + where.stderr
    trace = run("trace", "--prompt", "Hi", "--max-tokens", "4", "--log-level", "info")
    assert trace.returncode == 0, trace.stderr[-3000:]
    assert re.search(r"quantized (avx2|avxvnni|avx512-vnni) integer kernels", trace.stdout), trace.stdout
    assert "native CPU decode kernel" in trace.stdout, trace.stdout
    assert "not built" not in trace.stderr and "do not load" not in trace.stderr, trace.stderr

    prompt = ["generate", "Name three colors.", "--max-tokens", "24"]
    default = run(*prompt)
    # The integer kernels' AVX2 path forced (a tuning knob: set in the process, not the environment).
    forced_cli = "import sys; from pagedllm import tuning; from pagedllm.cli.main import main; "
    forced_cli += "tuning.configure(quant_isa='avx2'); sys.exit(main(sys.argv[1:]))"
    forced = subprocess.run(
        [str(runner), "-c", forced_cli, *prompt], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert default.returncode == 0 and forced.returncode == 0, default.stderr[-2000:] + forced.stderr[-2000:]
    assert default.stdout.strip() and forced.stdout == default.stdout
    # The wheel holds every level, and capped with PAGEDLLM_NATIVE_ISA it registers that level's
    # objects: the AVX2 ones give the host level's greedy tokens.
    if sysconfig.get_platform() != "linux-x86_64" or "avx2" not in Path("/proc/cpuinfo").read_text():
        return
    (lib,) = (tmp_path / "run-venv").glob("lib/python*/site-packages/pagedllm/native/_kernels*.so")
    if shutil.which("objdump") is not None:
        _check_levels(lib, ["base", "avx2", "avxvnni", "avxvnni (EVEX twin)", "avx512vnni", "avx512bf16"])
    level = "import pagedllm.native as n; print(n.cpu_kernels().native_isa())"
    capped = subprocess.run(
        [str(runner), "-c", level],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**env, "PAGEDLLM_NATIVE_ISA": "avx2"},
    )
    assert capped.stdout.strip() == "avx2", capped.stdout + capped.stderr
    on_avx2 = run(*prompt, PAGEDLLM_NATIVE_ISA="avx2")
    assert on_avx2.returncode == 0, on_avx2.stderr[-2000:]
    assert on_avx2.stdout == default.stdout
