"""`pagedllm bench speculative`: every mode runs the same prompts, and the report carries each
mode's decode rate and whole-request rate (prefill included) beside plain decoding's."""

from __future__ import annotations

import json

import pytest

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow


def test_speculative_bench_reports_decode_and_whole_requests(tmp_path, capsys):
    from pagedllm.cli.main import main

    out = tmp_path / "spec.json"
    rc = main(
        [
            "bench",
            "speculative",
            "--draft",
            "default",
            "--draft-vocab",
            "4096",
            "--code-requests",
            "1",
            "--code-tokens",
            "24",
            "--chat-requests",
            "1",
            "--chat-tokens",
            "8",
            "--workloads",
            "code,chat",
            "--runs",
            "1",
            "--output",
            str(out),
        ]
    )
    assert rc in (0, None)
    printed = capsys.readouterr().out
    assert "whole requests, prefill included" in printed
    report = json.loads(out.read_text())
    assert report["speculative"]["draft"]["draft_vocab"] == 4096
    for name in ("code", "chat"):
        r = report[name]
        whole = r["request_tok_s"]
        assert set(whole) == {"plain", "ngram", "draft", "draft+ngram"}
        for mode, w in whole.items():
            assert w["median"] > 0 and len(w["runs"]) == 1
            assert w["speedup"] == w["median"] / whole["plain"]["median"]
    # The code edit mostly copies its prompt: n-gram lookup proposes, and some are accepted.
    assert report["code"]["proposed"] > 0 and report["code"]["accepted"] > 0
