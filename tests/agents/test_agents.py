"""The coding agents themselves against `pagedllm serve` (`make agents`; not part of `make test`:
each first turn is minutes of prefill on two cores).

Each agent is installed as a user installs it (npm, or pip into its own venv) into a cache
outside the repository (~/.cache/pagedllm/agents, or PAGEDLLM_AGENTS_HOME), and run once,
non-interactively, in a scratch git repository, with one instruction, against the real
Qwen2.5-Coder-1.5B file (../shared/models/fetch-qwen-coder.sh, or PAGEDLLM_AGENT_MODEL)
served with `--record-requests`, up to 3 runs an agent (PAGEDLLM_AGENT_ATTEMPTS) until one has
a tool executed. What is checked is the protocol, not the model's skill:
every request the agent made was answered 2xx, at least one tool call the model made reached
the agent and was executed (the agent's own output shows the tool's result), and a later
request read its prompt's prefix from the cache. Whether the file ended right is printed.
The recorded requests stay in the run's folder, for `pagedllm bench agent`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from test_server import free_port  # noqa: E402

HOME = Path(os.environ.get("PAGEDLLM_AGENTS_HOME", Path.home() / ".cache/pagedllm/agents"))
MODEL = Path(
    os.environ.get(
        "PAGEDLLM_AGENT_MODEL", Path.home() / ".cache/pagedllm/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    )
)
INSTRUCTION = "Change 'a - b' to 'a + b' in calc.py."
TURN_TIMEOUT_S = float(os.environ.get("PAGEDLLM_AGENT_TIMEOUT", "2400"))
ATTEMPTS = int(os.environ.get("PAGEDLLM_AGENT_ATTEMPTS", "3"))
NPM = {
    "claude": ("@anthropic-ai/claude-code", "2.1.337"),
    "codex": ("@openai/codex", "0.171.0"),
    "opencode": ("opencode-ai", "1.18.33"),
    "qwen": ("@qwen-code/qwen-code", "0.24.4"),
}
AIDER = "aider-chat==0.86.2"


def npm_bin(name: str) -> Path:
    """The agent's command, installed into HOME by npm on first use."""
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: the npm agents cannot be installed (apt-get install nodejs npm)")
    binary = HOME / "node_modules" / ".bin" / name
    if not binary.exists():
        pkg, version = NPM[name]
        subprocess.run(["npm", "install", "--prefix", str(HOME), f"{pkg}@{version}"], check=True)
        if name == "claude":  # npm 11 holds back install scripts it was not told to allow
            subprocess.run(["node", "install.cjs"], cwd=HOME / "node_modules" / pkg, check=True)
    return binary


def aider_bin() -> Path:
    venv = HOME / "aider-venv"
    if not (venv / "bin" / "aider").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", AIDER], check=True)
    return venv / "bin" / "aider"


class Served:
    """`pagedllm serve` on the real model, recording every request."""

    def __init__(self, folder: Path) -> None:
        if not MODEL.is_file():
            pytest.skip(f"{MODEL} is not here: run ../shared/models/fetch-qwen-coder.sh")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.records = folder / "requests"
        self.log = folder / "server.log"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagedllm",
                "serve",
                str(MODEL),
                "--served-model-name",
                "qwen",
                "--port",
                str(self.port),
                "--record-requests",
                str(self.records),
                "--log-level",
                "info",
            ],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )
        import httpx

        for _ in range(600):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError("the server did not start")

    def requests(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.records.glob("*.json"))]

    def cached_prompt_tokens(self) -> float:
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=10).text
        m = re.search(r"^pagedllm_cached_prompt_tokens_total ([0-9.e+]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def scratch_repo(folder: Path) -> Path:
    repo = folder / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text("def calc(a, b):\n    return a - b\n")
    git = ["git", "-c", "user.email=agent@example.com", "-c", "user.name=agent"]
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "calc"], cwd=repo, check=True)
    return repo


def claude(server: Served, repo: Path, home: Path) -> tuple[list[str], dict]:
    cmd = [
        str(npm_bin("claude")),
        "-p",
        INSTRUCTION,
        "--model",
        "qwen",
        "--permission-mode",
        "acceptEdits",
        "--output-format",
        "stream-json",
        "--verbose",
    ]
    return cmd, {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "local", "HOME": str(home)}


def claude_ran_a_tool(out: str) -> bool:
    for line in out.splitlines():
        if line.startswith("{"):
            msg = json.loads(line)
            if msg.get("type") == "user" and any(
                c.get("type") == "tool_result" and not c.get("is_error")
                for c in msg["message"]["content"]
                if isinstance(c, dict)
            ):
                return True
    return False


def codex(server: Served, repo: Path, home: Path) -> tuple[list[str], dict]:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        'model = "qwen"\nmodel_provider = "pagedllm"\n[model_providers.pagedllm]\nname = "pagedllm"\n'
        f'base_url = "{server.url}/v1"\nwire_api = "responses"\n'
    )
    cmd = [str(npm_bin("codex")), "exec", "--json", "--sandbox", "workspace-write", INSTRUCTION]
    return cmd, {"CODEX_HOME": str(home)}


def codex_oss(server: Served, repo: Path, home: Path) -> tuple[list[str], dict]:
    home.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(npm_bin("codex")),
        "exec",
        "--oss",
        "--local-provider",
        "ollama",
        "-m",
        "qwen",
        "--json",
        "--sandbox",
        "workspace-write",
        INSTRUCTION,
    ]
    return cmd, {"CODEX_HOME": str(home), "CODEX_OSS_BASE_URL": f"{server.url}/v1"}


def codex_ran_a_tool(out: str) -> bool:
    return bool(
        re.search(
            r'"type":"item.completed","item":\{[^}]*"type":"(command_execution|file_change|'
            r'mcp_tool_call)"',
            out,
        )
    )


def opencode(server: Served, repo: Path, home: Path) -> tuple[list[str], dict]:
    (repo / "opencode.json").write_text(
        json.dumps(
            {
                "$schema": "https://opencode.ai/config.json",
                "provider": {
                    "pagedllm": {
                        "npm": "@ai-sdk/openai-compatible",
                        "name": "pagedllm",
                        "options": {"baseURL": f"{server.url}/v1"},
                        "models": {"qwen": {"name": "qwen"}},
                    }
                },
            }
        )
    )
    cmd = [
        str(npm_bin("opencode")),
        "run",
        "-m",
        "pagedllm/qwen",
        "--format",
        "json",
        "--auto",
        "--print-logs",
        INSTRUCTION,
    ]
    return cmd, {"HOME": str(home)}


def opencode_ran_a_tool(out: str) -> bool:
    # A tool that ran reports its result: its output ("completed"), or the error it met (a file
    # the model named that is not there), with the time it ran.
    return bool(re.search(r'"type":"tool_use".*"state":\{"status":"(completed|error)".*"time":\{"start"', out))


def qwen_code(server: Served, repo: Path, home: Path) -> tuple[list[str], dict]:
    cmd = [str(npm_bin("qwen")), INSTRUCTION, "--yolo", "--output-format", "stream-json"]
    return cmd, {
        "OPENAI_BASE_URL": f"{server.url}/v1",
        "OPENAI_API_KEY": "local",
        "OPENAI_MODEL": "qwen",
        "QWEN_CODE_API_TIMEOUT_MS": str(int(TURN_TIMEOUT_S * 1000)),
        "HOME": str(home),
    }


def qwen_ran_a_tool(out: str) -> bool:
    return '"tool_result"' in out and '"is_error":false' in out


def aider(server: Served, repo: Path, home: Path) -> tuple[list[str], dict]:
    cmd = [
        str(aider_bin()),
        "--model",
        "openai/qwen",
        "--message",
        INSTRUCTION,
        "--yes-always",
        "--no-auto-commits",
        "--no-show-model-warnings",
        "--no-check-update",
        "--no-analytics",
        "calc.py",
    ]
    return cmd, {"OPENAI_API_BASE": f"{server.url}/v1", "OPENAI_API_KEY": "local", "HOME": str(home)}


def aider_ran_a_tool(out: str) -> bool:
    # aider has no tool calls: its edits are blocks in the answer, which it applies itself.
    return "Applied edit to calc.py" in out


AGENTS = {
    "claude-code": (claude, claude_ran_a_tool),
    "codex": (codex, codex_ran_a_tool),
    "codex-oss": (codex_oss, codex_ran_a_tool),
    "opencode": (opencode, opencode_ran_a_tool),
    "qwen-code": (qwen_code, qwen_ran_a_tool),
    "aider": (aider, aider_ran_a_tool),
}


@pytest.mark.parametrize("agent", list(AGENTS))
def test_agent_loop(agent, tmp_path_factory):
    """Up to ATTEMPTS runs of the agent against one server, the repository reset before each,
    until one has a tool call executed: the model samples, and a small model does not call a
    tool every time (a fresh server's first answer is the same each start; the next runs differ)."""
    folder = Path(os.environ.get("PAGEDLLM_AGENT_RUNS", tmp_path_factory.mktemp(agent))) / agent
    folder.mkdir(parents=True, exist_ok=True)
    setup, ran_a_tool = AGENTS[agent]
    server = Served(folder)
    try:
        ran = False
        # One repository and home for every run: agents put their paths in the system prompt,
        # so the runs after the first read it from the cache, as a user's next session would.
        repo = scratch_repo(folder)
        (folder / "home").mkdir(exist_ok=True)
        for attempt in range(ATTEMPTS):
            subprocess.run(["git", "checkout", "-q", "--", "."], cwd=repo, check=True)
            cmd, env = setup(server, repo, folder / "home")
            t0 = time.time()
            # (PWD as a shell would set it: opencode takes its project folder, where its
            # opencode.json is, from it rather than from the process's working directory)
            proc = subprocess.run(
                cmd,
                cwd=repo,
                env={**os.environ, "PWD": str(repo), **env},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=TURN_TIMEOUT_S * 4,
            )
            out = proc.stdout + proc.stderr
            (folder / f"agent-run{attempt}.log").write_text(out)
            ran = ran_a_tool(out)
            print(
                f"{agent} run {attempt}: exit {proc.returncode} after {time.time() - t0:.0f} s, a tool "
                f"executed: {ran}; calc.py now: {(repo / 'calc.py').read_text().strip()!r}"
            )
            if ran:
                break
        requests = server.requests()
        statuses = [r["status"] for r in requests]
        print(
            f"{agent}: {len(requests)} requests {statuses}, prompt tokens from the cache "
            f"{server.cached_prompt_tokens():.0f}; logs and requests in {folder}"
        )
        assert requests and all(s is not None and 200 <= s < 300 for s in statuses), statuses
        assert ran, f"no tool call of the model was executed in {ATTEMPTS} runs; the last run's output: {out[-3000:]}"
        if len(requests) > 1:  # (aider's one-turn edit has no later turn)
            assert server.cached_prompt_tokens() > 0, "no later request read its prefix from the cache"
    finally:
        server.stop()
