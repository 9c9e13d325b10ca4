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
    r = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 2 kept, 0 broken." in r.stdout, r.stdout
