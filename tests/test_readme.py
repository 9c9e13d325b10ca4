"""The README's Python examples run as written: each ```python block in its own interpreter,
with only `max_tokens=N` made small (and, for the openai client, the port of a real
`pagedllm serve` started here)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_server import ServerProcess, free_port

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parent.parent / "README.md"
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _small(code: str) -> str:
    return re.sub(r"max_tokens=\d+", "max_tokens=4", code)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=ENV, cwd=README.parent)


def test_readme_has_the_examples():
    blocks = python_blocks()
    assert len(blocks) >= 3
    assert any("LLM(" in b for b in blocks) and any("Runner(" in b for b in blocks)
    assert any("OpenAI(" in b for b in blocks)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs(index, smollm2_gguf_path, tmp_path):
    code = _small(python_blocks()[index])
    srv = None
    if "base_url=" in code:
        pytest.importorskip("openai")
        port = free_port()
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        srv = ServerProcess(["serve", "--port", str(port), "--pa-gpu-mem", "128"], port,
                            tmp_path / "serve.log")
    try:
        if srv is not None:
            srv.wait_ready()
        r = _run(code)
    finally:
        if srv is not None:
            srv.stop()
    assert r.returncode == 0, f"README block {index} failed:\n{code}\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), code
    assert "Traceback" not in r.stderr
