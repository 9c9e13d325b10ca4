"""`pagedllm bench router`'s workload and per-request records, and the queue time the engine
reports for them: --think-time pauses are drawn once (every policy gets the same arrivals), each
turn waits its pause after the last answer, and the records' prompt and cached tokens (the
server's own usage) add up to the server's /metrics counters."""

from __future__ import annotations

import argparse
import asyncio
import os
import urllib.request

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench import router as br
from pagedllm.server import replicas as rp


def test_pauses_are_drawn_once_with_the_mean_asked():
    a = br.pauses(16, 6, 5.0, seed=3)
    assert a == br.pauses(16, 6, 5.0, seed=3)  # the same arrivals for every policy of a run
    assert a != br.pauses(16, 6, 5.0, seed=4)
    flat = [w for conv in a for w in conv]
    assert len(a) == 16 and all(len(conv) == 6 for conv in a) and all(w > 0 for w in flat)
    assert 3.5 < sum(flat) / len(flat) < 6.5
    assert br.pauses(4, 3, 0.0) == [[0.0] * 3] * 4  # closed loop
    with pytest.raises(ValueError, match="think-time"):
        br.pauses(4, 3, -1.0)


def test_think_time_option(capsys):
    p = argparse.ArgumentParser()
    br.add_arguments(p)
    assert p.parse_args([]).think_time == br.THINK_TIME_S
    assert p.parse_args(["--think-time", "7.5"]).think_time == 7.5
    for bad in ("-2", "soon", "nan"):
        with pytest.raises(SystemExit):
            p.parse_args(["--think-time", bad])
        assert "give a pause in seconds, 0 or more" in capsys.readouterr().err


def test_queue_time_is_arrival_to_first_scheduled_step():
    """One sequence at a time: the second request waits until the first has finished."""
    llm = LLM("default", max_model_len=256, kv_cache_memory_mb=16, max_num_seqs=1)
    outs = llm.generate(
        ["The capital of France is", "Once upon a time"],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    first, second = (o.metrics for o in outs)
    for m in (first, second):
        assert m.queue_time is not None and 0 <= m.queue_time <= m.time_to_first_token
    assert second.first_scheduled_time >= first.finished_time
    assert second.queue_time > first.queue_time


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return {
            line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
            for line in r.read().decode().splitlines()
            if line and not line.startswith("#")
        }


def test_drive_records_every_turn_after_its_pause(tmp_path):
    pytest.importorskip("httpx")
    core = sorted(os.sched_getaffinity(0))[:1]
    rep = rp.Replica(0, ["default", "--max-model-len", "1024"], rp.free_port(), core, tmp_path)
    rep.start()
    try:
        rp.wait_healthy(rep.url, rep.proc, 300)
        convs = br.conversations(2, 3, 150, seed=1)
        waits = [[0.2, 0.6, 0.4], [0.0, 0.5, 0.3]]
        res = asyncio.run(br._drive(rep.url, br._model_name(rep.url), convs, waits, 4))
        m = _metrics(rep.url)
    finally:
        rep.proc.terminate()
        rep.proc.wait(30)
    recs = res["requests"]
    assert sorted((r["conversation"], r["turn"]) for r in recs) == [(c, t) for c in range(2) for t in range(3)]
    for c in range(2):
        mine = sorted((r for r in recs if r["conversation"] == c), key=lambda r: r["turn"])
        assert mine[0]["sent_s"] >= waits[c][0]
        for prev, cur in zip(mine, mine[1:]):
            # the next turn goes after the answer (TTFT is a lower bound on it) and the pause
            assert cur["sent_s"] >= prev["sent_s"] + prev["ttft"] + waits[c][cur["turn"]]
            assert cur["prompt_tokens"] > prev["prompt_tokens"]
            assert cur["cached_tokens"] > 0  # the history is the server's cached prefix
        assert all(r["tokens"] == 4 for r in mine)
    assert sum(r["prompt_tokens"] for r in recs) == m["pagedllm_prompt_tokens_total"]
    assert sum(r["cached_tokens"] for r in recs) == m["pagedllm_cached_prompt_tokens_total"]
    assert m["pagedllm_request_queue_time_seconds_count"] == 6
    last = [r for r in recs if r["turn"] == 2]
    assert res["last_ttft_p50"] == pytest.approx(
        sorted(r["ttft"] for r in last)[0] / 2 + sorted(r["ttft"] for r in last)[1] / 2
    )
    assert res["output_tok_s"] == pytest.approx(24 / res["wall_s"])
