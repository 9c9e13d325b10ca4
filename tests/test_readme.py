"""The README's and the docs' examples run as written.

What runs: every ```python block of README.md and of the pages under docs/, each in its own
interpreter, and every ```bash block right after a `<!-- test: run -->` line, each line a command
(`pagedllm ...` runs this checkout's CLI). An example that cannot run here (it needs a LoRA
folder, a vision model, another machine) is fenced ```py instead: highlighted, not run. Only
`max_tokens=N` / `--max-tokens N` are made small, and, for the openai client, the port is that
of a real `pagedllm serve` started here."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from test_server import ServerProcess, free_port

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def python_blocks(path: Path = README) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def shell_blocks(path: Path) -> list[str]:
    return re.findall(r"^<!-- test: run -->\n```bash\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def _blocks(kind) -> list[tuple[str, int]]:
    return [(str(p.relative_to(ROOT)), i) for p in PAGES for i in range(len(kind(p)))]


def _small(code: str) -> str:
    return re.sub(r"--max-tokens \d+", "--max-tokens 4", re.sub(r"max_tokens=\d+", "max_tokens=4", code))


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)


def test_readme_has_the_examples():
    blocks = python_blocks()
    assert len(blocks) >= 3
    assert any("LLM(" in b for b in blocks) and any("Runner(" in b for b in blocks)
    assert any("OpenAI(" in b for b in blocks)
    assert shell_blocks(README), "the README's quickstart shows a CLI command that runs"
    # A newcomer's first two commands, first (the project's guide).
    first = re.search(r"^```bash\n(.*?)^```", README.read_text(), flags=re.S | re.M).group(1).splitlines()
    assert [line.split()[:2] for line in first] == [["make", "run"], ["make", "test"]]


@pytest.mark.parametrize("page,index", _blocks(python_blocks))
def test_python_block_runs(page, index, smollm2_gguf_path, tmp_path):
    code = _small(python_blocks(ROOT / page)[index])
    srv = None
    if "base_url=" in code:
        pytest.importorskip("openai")
        port = free_port()
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        srv = ServerProcess(["serve", "--port", str(port), "--pa-gpu-mem", "128"], port, tmp_path / "serve.log")
    try:
        if srv is not None:
            srv.wait_ready()
        r = _run(code)
    finally:
        if srv is not None:
            srv.stop()
    assert r.returncode == 0, f"{page} block {index} failed:\n{code}\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), code
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("page,index", _blocks(shell_blocks))
def test_shell_block_runs(page, index, smollm2_gguf_path):
    for line in _small(shell_blocks(ROOT / page)[index]).splitlines():
        cmd = shlex.split(line.split(" #")[0])
        if not cmd:
            continue
        assert cmd[0] == "pagedllm", f"{page}: only pagedllm commands are run here: {line}"
        r = subprocess.run(
            [sys.executable, "-m", "pagedllm", *cmd[1:]], capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT
        )
        assert r.returncode == 0, f"{page}: {line}\n{r.stderr[-3000:]}"
        assert r.stdout.strip(), line
