"""The tree is linted and formatted as pyproject's [tool.ruff] says: `ruff check` and
`ruff format --check` pass over the package, the tests, tools and setup.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATHS = ["pagedllm", "tests", "tools", "setup.py"]


def _ruff() -> str:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed: pip install ruff (the dev extra has it)")
    return exe


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_passes(command):
    r = subprocess.run([_ruff(), *command, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
