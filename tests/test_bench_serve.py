"""`pagedllm bench serve --against-throughput`: one workload through the offline engine and a
spawned server with streaming OpenAI clients; both sides must do exactly the same work."""

from __future__ import annotations

import json
import math
import socket

import pytest

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

pytest.importorskip("openai")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_against_throughput_runs_the_same_workload_on_both_sides(tmp_path, smollm2_gguf_path, capsys):
    from pagedllm.cli.main import main
    from pagedllm.bench.throughput import make_workload

    out = tmp_path / "serve.json"
    rc = main(
        [
            "bench",
            "serve",
            "--against-throughput",
            "--url",
            f"http://127.0.0.1:{_free_port()}",
            "--num-requests",
            "3",
            "--min-prompt",
            "8",
            "--max-prompt",
            "12",
            "--min-output",
            "3",
            "--max-output",
            "5",
            "--runs",
            "1",
            "--request-rates",
            "inf,50",
            "--seed",
            "5",
            "--output",
            str(out),
            "--server-args",
            str(smollm2_gguf_path),
            "--max-seqs",
            "4",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "ratio server/offline output tok/s" in printed
    report = json.loads(out.read_text())
    assert set(report["by_rate"]) == {"all-at-once", "poisson-50/s"}
    # EOS is ignored, so each request generates exactly its output length: the workload's total.
    from gguf import GGUFReader

    vocab = len(GGUFReader(smollm2_gguf_path).fields["tokenizer.ggml.tokens"].data)
    for name, r in report["by_rate"].items():
        for side in ("offline", "server"):
            s = r[side]
            for key in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms"):
                assert isinstance(s[key], float) and math.isfinite(s[key]) and s[key] >= 0, (name, side, key)
            assert s["requests"] == 3 and s["errors"] == 0
            assert s["output_tokens_per_s"] > 0 and s["ttft_p99_s"] >= s["ttft_p50_s"]
        assert r["offline"]["output_tokens"] == r["server"]["output_tokens"]
        assert r["same_tokens"] is True
        assert r["ratio_output_tokens_per_s"] == pytest.approx(
            r["server"]["output_tokens_per_s"] / r["offline"]["output_tokens_per_s"]
        )
    # The output lengths are the seeded workload's, whatever the tokenizer's EOS ids are.
    lens = make_workload(3, vocab, 5, (8, 12), (3, 5)).output_lens
    assert report["by_rate"]["all-at-once"]["offline"]["output_tokens"] == sum(lens)
    assert len(report["load_average"]) == 1
