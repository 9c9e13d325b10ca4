"""`pagedllm bench startup` beside llama.cpp: which GGUF the peer gets, and the line that says
why it is skipped."""

from __future__ import annotations

import importlib.util

from pagedllm.bench import startup
from pagedllm.bench.llamacpp_peer import MISSING_HINT


def test_llama_cpp_side_runs_the_same_gguf_or_says_why_not(monkeypatch, smollm2_gguf_path, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert startup.llama_cpp_skip_reason("default") == (MISSING_HINT, "")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "llama_cpp" else real(name, *a)
    )
    assert startup.llama_cpp_skip_reason("default") == (None, str(smollm2_gguf_path))
    folder = tmp_path / "model"
    folder.mkdir()
    why, path = startup.llama_cpp_skip_reason(str(folder))
    assert path == "" and "not a .gguf file" in why


def test_the_llama_cpp_child_is_valid_python():
    compile(startup.LLAMA_CPP_CHILD, "<llama.cpp child>", "exec")
