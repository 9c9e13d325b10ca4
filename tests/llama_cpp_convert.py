"""llama.cpp's own converters (convert_lora_to_gguf.py, convert_hf_to_gguf.py), run as subprocesses:
the reference writers of GGUF LoRA adapters and GGUF models for the tests.

They are not vendored here (they need llama.cpp's conversion/ package and gguf-py beside them, 2 MB
of another project). They are found in PAGEDLLM_LLAMA_CPP_DIR (a llama.cpp checkout), else in the
llama-cpp-python sdist (it vendors llama.cpp), which is fetched once from PyPI with pip into
pytest's cache and unpacked there (only the converters, conversion/ and gguf-py/)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
_SDIST = "llama_cpp_python-0.3.36"
_KEEP = ("convert_lora_to_gguf.py", "convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")


def _usable(folder: Path) -> bool:
    return all((folder / p).exists() for p in ("convert_lora_to_gguf.py", "conversion", "gguf-py"))


def find_llama_cpp(cache_dir: Path) -> Path:
    """The folder holding llama.cpp's converters, fetched into `cache_dir` if need be; skips the
    test with what to do when it cannot be found or fetched."""
    given = os.environ.get("PAGEDLLM_LLAMA_CPP_DIR")
    if given:
        if not _usable(Path(given)):
            pytest.fail(
                f"PAGEDLLM_LLAMA_CPP_DIR={given} holds no convert_lora_to_gguf.py with conversion/ "
                "and gguf-py/ beside it (give a llama.cpp checkout)"
            )
        return Path(given)
    folder = cache_dir / _SDIST / "vendor" / "llama.cpp"
    if _usable(folder):
        return folder
    fetched = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            LLAMA_CPP_PYTHON,
            "--no-deps",
            "--no-binary",
            ":all:",
            "-q",
            "-d",
            str(cache_dir),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    sdist = cache_dir / f"{_SDIST}.tar.gz"
    if fetched.returncode != 0 or not sdist.is_file():
        pytest.skip(
            f"llama.cpp's convert_lora_to_gguf.py not found: set PAGEDLLM_LLAMA_CPP_DIR to a llama.cpp "
            f"checkout, or let `pip download {LLAMA_CPP_PYTHON} --no-binary :all:` reach PyPI "
            f"({fetched.stderr.strip()[-300:]})"
        )
    prefix = f"{_SDIST}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.name[len(prefix) :].startswith(_KEEP)]
        tar.extractall(cache_dir, members=members, filter="data")
    sdist.unlink()
    return folder


def convert(llama_cpp: Path, script: str, *args: str) -> None:
    """Run one of llama.cpp's converters with this Python; its output is shown when it fails."""
    done = subprocess.run(
        [sys.executable, str(llama_cpp / script), *map(str, args)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
