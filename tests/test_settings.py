"""The environment variables: one typed Settings, one table of them, read at the point of use."""

from __future__ import annotations

import os
import re
from dataclasses import fields
from pathlib import Path

import pytest

from pagedllm import settings
from pagedllm.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "pagedllm"


def _env_names() -> set[str]:
    return {f.metadata["env"] for f in fields(Settings)}


def test_the_docs_table_lists_exactly_the_settings():
    text = (ROOT / "docs" / "configuration.md").read_text()
    listed = re.findall(r"^\| `(PAGEDLLM_[A-Z0-9_]+)` \|", text, flags=re.M)
    assert sorted(listed) == sorted(_env_names()) and len(listed) == len(set(listed))
    assert settings.table() in text  # rows as generated: type, default, layer and purpose too


def test_every_variable_the_code_reads_is_a_setting():
    # Python reads PAGEDLLM_* only through pagedllm/settings.py; the C++ sources and setup.py
    # read theirs with getenv / os.environ, and each is a field (with its layer) too.
    py_reads = re.compile(r"(?:os\.environ\.get|os\.getenv|os\.environ\[)\(?\s*[\"'](PAGEDLLM_[A-Z0-9_]+)")
    for path in PKG.rglob("*.py"):
        if path.name != "settings.py":
            assert not py_reads.findall(path.read_text()), f"{path} reads a PAGEDLLM_ variable itself"
    cpp = {
        m
        for p in (PKG / "native" / "csrc").iterdir()
        if p.suffix in (".cpp", ".h")
        for m in re.findall(r"getenv\(\"(PAGEDLLM_[A-Z0-9_]+)\"\)", p.read_text())
    }
    setup = set(re.findall(r"environ\.get\(\"(PAGEDLLM_[A-Z0-9_]+)\"", (ROOT / "setup.py").read_text()))
    assert cpp and setup and cpp | setup <= _env_names()
    layers = {f.metadata["env"]: f.metadata["layer"] for f in fields(Settings)}
    assert all("C++" in layers[n] for n in cpp) and all(layers[n] == "setup.py" for n in setup)


def test_kernel_modules_read_no_environment_at_import():
    for folder in ("quant", "native", "attention"):
        for path in (PKG / folder).glob("*.py"):
            assert "os.environ" not in path.read_text(), f"{path} reads the environment itself"


def test_a_variable_changed_after_import_takes_effect(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_TP_TIMEOUT_S", "7")
    assert settings.get("tp_timeout_s") == 7.0 and Settings.from_env().tp_timeout_s == 7.0
    monkeypatch.delenv("PAGEDLLM_TP_TIMEOUT_S")
    assert settings.get("tp_timeout_s") == 60.0


def test_bad_values_are_refused_with_the_variable_named(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_PP_TIMEOUT_S", "many")
    with pytest.raises(ValueError, match="PAGEDLLM_PP_TIMEOUT_S='many' is not a number"):
        settings.get("pp_timeout_s")
    monkeypatch.setenv("PAGEDLLM_NATIVE_ISA", "fast")
    with pytest.raises(ValueError, match="PAGEDLLM_NATIVE_ISA='fast' is not one of base, avx2"):
        Settings.from_env()


def test_from_env_reads_a_given_mapping():
    s = Settings.from_env(
        {"PAGEDLLM_NATIVE": "off", "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "PAGEDLLM_TP_TIMEOUT_S": "2.5"}
    )
    assert (s.native, s.allow_long_max_model_len, s.tp_timeout_s, s.huge_pages) == (False, True, 2.5, True)
    with pytest.raises(AttributeError):  # frozen
        s.native = True  # type: ignore[misc]


@pytest.mark.parametrize("off", ["0", "false", "off", "no"])
def test_the_native_library_reads_a_variable_as_python_does(off):
    # One parser: PAGEDLLM_HUGE_PAGES=false meant off to Python and on to the C++ reader (which
    # compared with "0" only); Python writes the parsed value back as "0".
    import subprocess
    import sys

    def huge_pages(value: str) -> str:
        code = "from pagedllm.quant.weight_memory import weight_memory as w; m = w(); print(m and m.huge_pages)"
        env = {**os.environ, "PAGEDLLM_HUGE_PAGES": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    if huge_pages("true") != "True":
        pytest.skip("no native kernels, or not Linux: no huge-page slabs to turn off")
    assert huge_pages(off) == "False"


def test_a_bad_value_for_the_native_library_is_refused_before_it_loads(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_NATIVE_ISA", "avx9")
    with pytest.raises(ValueError, match="PAGEDLLM_NATIVE_ISA='avx9' is not one of"):
        settings.export_for_native()
    monkeypatch.setenv("PAGEDLLM_NATIVE_ISA", "avx2")
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "off")
    settings.export_for_native()
    assert (os.environ["PAGEDLLM_NATIVE_ISA"], os.environ["PAGEDLLM_HUGE_PAGES"]) == ("avx2", "0")
