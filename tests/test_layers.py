"""The layering is checked, not hoped for: import-linter's contracts in pyproject.toml (layers
only look down; models see the attention context interface only) must hold."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed: pip install import-linter (the dev extra has it)")
    # This checkout's package, whatever else is on the path.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(
        [exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 2 kept, 0 broken." in r.stdout, r.stdout


def test_every_top_level_module_is_in_a_layer():
    """A new package must take its place in the layers, not slip past the contract."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    layers = next(c for c in cfg["tool"]["importlinter"]["contracts"] if c["type"] == "layers")["layers"]
    named = {name.strip("()") for layer in layers for name in layer.split("|")}
    pkg = ROOT / "pagedllm"
    tops = {f"pagedllm.{p.name}" for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    tops |= {f"pagedllm.{p.stem}" for p in pkg.glob("*.py") if p.name != "__init__.py"}
    assert tops - named == set(), f"top-level modules in no layer of pyproject.toml: {sorted(tops - named)}"


def test_no_import_circle_inside_a_package():
    """tools/import_cycles.py counts every import statement, lazy (in-function) ones included,
    which import-linter's layers between packages do not forbid inside one."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "import_cycles.py"), str(ROOT / "pagedllm")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "0 circle(s)" in r.stdout, r.stdout + r.stderr


def test_import_cycles_finds_a_lazy_circle(tmp_path):
    """The counter is not blind: a circle closed by a function-level import is reported."""
    pkg = tmp_path / "pagedllm" / "demo"
    pkg.mkdir(parents=True)
    (tmp_path / "pagedllm" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "import_cycles.py"), str(tmp_path / "pagedllm")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "circle among: pagedllm.demo.a, pagedllm.demo.b" in r.stdout, r.stdout
