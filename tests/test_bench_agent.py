"""`pagedllm bench agent`: the shipped agent sessions render to the prompts pagedllm's server
builds, and a replay through the real server reads later turns from its cache."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.bench.agent_session import load_turns, shared_prefix


def test_shipped_sessions_render_as_growing_prompts(smollm2_gguf_path):
    for name, routes in (("claude-code", ["/v1/messages"] * 4), ("codex", ["/v1/responses"] * 2)):
        turns, tok = load_turns(name, str(smollm2_gguf_path), 32768)
        assert [t.route for t in turns] == routes
        assert len(turns[0].ids) > 5000  # the agents' system prompts and tools
        for a, b in zip(turns, turns[1:]):
            # each turn repeats the one before it (its prompt, then the answer and tool result)
            assert shared_prefix(a.ids, b.ids) >= 0.99 * len(a.ids) and len(b.ids) > len(a.ids)
        for t in turns:  # the text both engines are sent tokenizes back to the same ids
            assert tok.encode(t.text, add_special_tokens=False) == t.ids


def _session(folder: Path) -> Path:
    system = {"role": "system", "content": "You are a careful coding assistant. " * 12}
    user = {"role": "user", "content": "Change 'a - b' to 'a + b' in calc.py."}
    later = [{"role": "assistant", "content": "Reading it."}, {"role": "user", "content": "def f(a, b): return a - b"}]
    folder.mkdir()
    for i, messages in enumerate([[system, user], [system, user, *later]], 1):
        body = {"model": "any", "messages": messages, "max_tokens": 100, "stream": True}
        rec = {"at_s": float(i), "method": "POST", "path": "/v1/chat/completions", "status": 200, "body": body}
        (folder / f"{i:05d}.json").write_text(json.dumps(rec))
    (folder / "00003.json").write_text(json.dumps({"method": "POST", "path": "/tokenize", "body": {}}))
    return folder


def _bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pagedllm", "bench", "agent", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("peer", [False, True])
def test_a_replay_reads_later_turns_from_the_cache(tmp_path, smollm2_gguf_path, peer):
    if peer and importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (`make bench-deps`): only pagedllm's replay runs")
    out = tmp_path / "agent.json"
    engines = "pagedllm,llama.cpp" if peer else "pagedllm"
    r = _bench(
        str(smollm2_gguf_path),
        "--session",
        str(_session(tmp_path / "s")),
        "--engines",
        engines,
        "--repeats",
        "1",
        "--max-tokens",
        "4",
        "--ctx",
        "2048",
        "--threads",
        "2",
        "--output",
        str(out),
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    prompts = result["prompt_tokens"]
    assert len(prompts) == 2 and prompts[1] > prompts[0]  # the /tokenize record is not a turn
    for name, eng in result["engines"].items():
        first, second = eng["computed_tokens"]
        assert first == prompts[0] and 0 < second < prompts[1] - prompts[0] // 2, (name, eng["computed_tokens"])
        assert all(t["ttft_s"] <= t["turn_s"] for t in eng["runs"][0]["turns"])
    for t in result["engines"]["pagedllm"]["runs"][0]["turns"]:
        assert t["usage"]["completion_tokens"] == 4  # end tokens forbidden: every turn runs to --max-tokens
    assert ("wall_ratio" in result) == peer


def test_bad_arguments_are_refused_with_what_to_do(tmp_path, smollm2_gguf_path):
    r = _bench(str(smollm2_gguf_path), "--engines", "vllm")
    assert r.returncode == 2 and "--engines 'vllm': choose from pagedllm, llama.cpp" in r.stderr
    r = _bench(str(smollm2_gguf_path), "--session", str(tmp_path / "nowhere"), "--engines", "pagedllm")
    assert r.returncode == 2 and "neither a shipped session (claude-code, codex)" in r.stderr, r.stderr
