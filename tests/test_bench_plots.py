"""`--plot PATH` of the benchmarks: each draws what its benchmark measured into a PNG
(matplotlib, the `plot` extra), from results in the shape the benchmark produces."""

from __future__ import annotations

import argparse

import pytest

plt = pytest.importorskip("matplotlib.pyplot")
image = pytest.importorskip("matplotlib.image")


def _png(path) -> tuple[int, int]:
    pixels = image.imread(str(path))
    assert pixels.ndim == 3 and pixels.std() > 0.01, "an empty picture"
    return pixels.shape[:2]


def test_bench_serve_plot(tmp_path):
    from pagedllm.bench.loadtest import Report, plot

    reports = [
        Report(
            duration_s=10,
            concurrency=c,
            requests=4 * c,
            errors=0,
            requests_per_s=0.4 * c,
            ttft_p50_s=0.1,
            ttft_p99_s=0.3,
            latency_p50_s=1,
            latency_p99_s=2,
            output_tokens=100 * c,
            output_tokens_per_s=10.0 * c,
            server_rss_start_mb=None,
            server_rss_end_mb=None,
            kv_blocks_used_after=0.0,
            ttft_samples_s=[0.05 * (i + 1) for i in range(4 * c)],
            itl_samples_s=[0.01 * (i + 1) for i in range(4 * c)],
        )
        for c in (1, 4, 16)
    ]
    plot(reports, str(tmp_path / "sub" / "serve.png"), title="t")
    h, w = _png(tmp_path / "sub" / "serve.png")
    assert w > 2 * h  # three panels side by side


def test_bench_serve_concurrency_levels_parse():
    from pagedllm.bench.loadtest import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--concurrency", "1,4,16"]).concurrency == [1, 4, 16]
    assert p.parse_args([]).concurrency == [16]
    for bad in ("0", "a,b", "4,"):
        with pytest.raises(SystemExit):
            p.parse_args(["--concurrency", bad])


def test_bench_speculative_plot(tmp_path):
    from pagedllm.bench.speculative import plot

    def workload(speed):
        return {
            "plain": 10.0,
            "ngram": 10.0 * speed,
            "speedup": speed,
            "acceptance_rate": 0.8,
            "mean_accepted_length": 3.0,
            "draft": 9.0,
            "draft_speedup": 0.9,
            "draft_acceptance_rate": 0.95,
            "draft_mean_accepted_length": 4.5,
        }

    result = {"args": {"model": "default", "num_tokens": 5}, "code": workload(2.0), "chat": workload(1.1)}
    plot(result, ["ngram", "draft"], ["code", "chat"], str(tmp_path / "spec.png"))
    _png(tmp_path / "spec.png")


def test_bench_prefix_plot(tmp_path):
    from pagedllm.bench.prefix import plot

    modes = ["cache on (token-exact)", "cache off"]
    result = {
        "args": {"model": "default", "conversations": 2, "turns": 3},
        **{m: {"by_turn": [[100.0 * t, 0.05 * t * (1 + j)] for t in (1, 2, 3)]} for j, m in enumerate(modes)},
    }
    plot(result, modes, str(tmp_path / "prefix.png"))
    _png(tmp_path / "prefix.png")


def test_bench_serve_against_throughput_plot(tmp_path):
    from pagedllm.bench.serve_offline import plot

    def side(tps):
        return {
            "output_tokens_per_s": tps,
            "ttft_p50_s": 0.5,
            "ttft_p99_s": 1.5,
            "itl_p50_ms": 20.0,
            "itl_p99_ms": 80.0,
        }

    result = {
        "by_rate": {
            name: {"offline": side(100.0), "server": side(90.0), "ratio_output_tokens_per_s": 0.9}
            for name in ("all-at-once", "poisson-4/s")
        }
    }
    plot(result, str(tmp_path / "against.png"))
    h, w = _png(tmp_path / "against.png")
    assert w > 2 * h
