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


def test_no_file_over_600_lines_and_no_function_over_60():
    # A reader finds one concern a file and one step a function (issue 79): the package is held
    # to it as ruff holds it to its style.
    import ast

    long_files, long_functions = [], []
    for path in sorted((ROOT / "pagedllm").rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 600:
            long_files.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long_files and not long_functions, long_files + long_functions
