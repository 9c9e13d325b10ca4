"""`LLM(pipeline_parallel_size=2)`: the engine on rank 0 (schedules, runs stage 0, samples), a
second process running stage 1 over its own paged KV cache, gloo on loopback, 1 thread each.

Greedy tokens equal transformers' float32 tokens and pp=1's for Llama, Qwen2 (tied head),
Gemma 3 (sliding and global KV groups, which stage 0's layers do not all fall in) and a
Mixtral-shaped mixture of experts at pp=2, and Llama, Qwen2 at pp=2 x tp=2 (Gemma 3 and Mixtral
at pp=2 x tp=2: tests/test_tp_models.py),
with preemption (a KV budget far below the batch's need), prefix caching (a multi-turn chat
reusing its earlier turns) and n=4 in the same run; each stage holds about half the weights
and half the KV bytes (the trace); a killed stage ends the request in flight with an error
within 30 s, and no process is left after the LLM is closed. One LLM per family serves every
assert (each start costs seconds on 2 cores)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest

from pagedllm import LLM, SamplingParams
from models import reference_family
from procs import alive, descendants

# slow: whole models in several processes; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

PROMPT_LENS = [1, 17, 64, 150, 300]
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# Blocks of 16, 400 tokens of KV for five prompts of up to 324 tokens: it must preempt. (Gemma 3's
# four KV groups get four times the blocks, its sliding ones holding a window each: 200 there.)
KW = dict(dtype="float32", block_size=16, kv_cache_context_len=400, max_num_batched_tokens=64)
# (Mixtral's layers all slide over 48 tokens, giving back the blocks behind: 208 there, what n=4 needs.)
CTX = {"gemma3": 200, "mixtral": 208}


def _same_as_pp1(one, prompts, got, turns, forks) -> None:
    """pp=1's workload gives pp=2's tokens, and the chat's later turns find as many cached
    tokens. (The first turn's cache hits depend on which blocks of the first batch survived its
    preemptions, and pp=2's micro-batches schedule that batch in other steps than pp=1.)"""
    got1, turns1, forks1 = _workload(one, prompts)
    assert (got1, [t for t, _ in turns1], forks1) == (got, [t for t, _ in turns], forks)
    assert [c for _, c in turns1[1:]] == [c for _, c in turns[1:]]


def _workload(llm, prompts):
    """(greedy tokens of every prompt, a three-turn chat's (tokens, cached tokens) per turn,
    n=4 greedy forks of prompt 1: its 17 tokens end in a shared partial block, which each fork
    copies before it writes there, on every stage)."""
    got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    conv, turns = [], []
    for t in (prompts[3][:100], prompts[4][:60], prompts[2][:40]):
        conv = conv + t
        o = llm.generate([conv], GREEDY, use_tqdm=False)[0]
        turns.append((o.token_ids, o.num_cached_tokens))
        conv = conv + o.token_ids
    forks = llm.generate(
        [prompts[1]], SamplingParams(n=4, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    return got, turns, [c.token_ids for c in forks.outputs]


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3", "mixtral"])
def test_pp2_matches_transformers_and_pp1(name, tmp_path, hf_smollm2_tokenizer):
    path, _, prompts, want = reference_family(
        name, tmp_path / name, hf_smollm2_tokenizer, PROMPT_LENS, NEW_TOKENS, seed=99
    )
    kw = {**KW, "kv_cache_context_len": CTX.get(name, KW["kv_cache_context_len"])}
    before = descendants()
    with LLM(str(path), pipeline_parallel_size=2, **kw) as llm:
        pids = llm.engine.executor.pids
        assert len(alive(pids)) == 1
        got, turns, forks = _workload(llm, prompts)
        assert got == want, name
        assert llm.engine.scheduler.num_preemptions > 0
        assert all(cached > 0 for _, cached in turns[1:])  # later turns reuse the earlier ones
        assert forks == [want[1]] * 4
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_usable_blocks
        t2 = llm.kv_cache_trace()
    assert not alive(pids)  # the context manager stopped the stage
    # Each rank reported where its time went (bench throughput's bubble profile): every step.
    stats = llm.engine.executor.stage_stats
    assert [s["steps"] for s in stats] == [llm.engine.executor.steps] * 2
    assert all(0 < s["busy_s"] < s["window_s"] and s["wait_s"] > 0 for s in stats), stats
    assert descendants() <= before

    one = LLM(str(path), **kw)
    _same_as_pp1(one, prompts, got, turns, forks)
    t1 = one.kv_cache_trace()
    assert t2.pipeline_parallel_size == 2 and len(t2.rank_weight_mb) == len(t2.rank_kv_mb) == 2
    assert t2.capacity_blocks == t1.capacity_blocks
    whole_w, whole_kv = t1.rank_weight_mb[0], t1.rank_kv_mb[0]
    assert all(w < whole_w for w in t2.rank_weight_mb)
    if name == "gemma3":
        # Groups of one layer (one global layer): a block is a page of one layer in each
        # group's table, and so on each stage too: no KV saving (docs/scale-out.md).
        assert t2.rank_kv_mb == [whole_kv, whole_kv]
    else:  # 3 layers: 2 + 1 or 1 + 2, a block's pages split alike
        assert sorted(t2.rank_kv_mb) == pytest.approx([whole_kv / 3, 2 * whole_kv / 3], rel=1e-6)
    assert t2.p2p_bytes_per_step > 0


def run_pp2_tp2(name, path, prompts, want, kw, groups: int | None = None):
    """The workload above at pp=2 x tp=2 (three processes beside this one, gone afterwards),
    against transformers' tokens and then pp=1's run: (its KV trace, pp=1's)."""
    before = descendants()
    with LLM(str(path), pipeline_parallel_size=2, tensor_parallel_size=2, **kw) as llm:
        pids = llm.engine.executor.pids
        assert len(alive(pids)) == 3
        if groups is not None:
            assert llm.engine.block_manager.num_groups == groups
        got, turns, forks = _workload(llm, prompts)
        assert got == want, name
        assert llm.engine.scheduler.num_preemptions > 0
        assert all(cached > 0 for _, cached in turns[1:])  # later turns reuse the earlier ones
        assert forks == [want[1]] * 4
        t4 = llm.kv_cache_trace()
    assert not alive(pids) and descendants() <= before
    one = LLM(str(path), **kw)
    _same_as_pp1(one, prompts, got, turns, forks)
    t1 = one.kv_cache_trace()
    assert (t4.pipeline_parallel_size, t4.tensor_parallel_size) == (2, 2) and len(t4.rank_kv_mb) == 4
    return t4, t1


# (Gemma 3 and Mixtral at pp=2 x tp=2: tests/test_tp_models.py.)
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_pp2_tp2_matches_transformers_and_pp1(name, tmp_path, hf_smollm2_tokenizer):
    """Four ranks, 1 thread each: two stages, each split over two tensor-parallel ranks (their
    all-reduces and logits gather in the stage's own group); the same workload as above."""
    path, _, prompts, want = reference_family(
        name, tmp_path / name, hf_smollm2_tokenizer, PROMPT_LENS, NEW_TOKENS, seed=99
    )
    kw = {**KW, "kv_cache_context_len": CTX.get(name, KW["kv_cache_context_len"])}
    t4, t1 = run_pp2_tp2(name, path, prompts, want, kw)
    whole_kv = t1.rank_kv_mb[0]
    # Each rank: its stage's layers (1 or 2 of 3) and half their KV heads.
    assert sum(t4.rank_kv_mb) == pytest.approx(whole_kv, rel=1e-6)
    assert sorted(t4.rank_kv_mb) == pytest.approx([whole_kv / 6] * 2 + [whole_kv / 3] * 2, rel=1e-6)
    assert all(w < t1.rank_weight_mb[0] / 2 for w in t4.rank_weight_mb)


def test_killed_stage_fails_the_request_and_leaves_no_process(tmp_path, hf_smollm2_tokenizer):
    from models import build_checkpoint

    tok = hf_smollm2_tokenizer
    path = build_checkpoint("llama", tmp_path / "m", tok, len(tok))
    os.environ["PAGEDLLM_PP_TIMEOUT_S"] = "10"
    try:
        llm = LLM(str(path), dtype="float32", kv_cache_context_len=4096, pipeline_parallel_size=2)
    finally:
        del os.environ["PAGEDLLM_PP_TIMEOUT_S"]
    pids = llm.engine.executor.pids
    for kw in ({"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}):  # one group per process
        with pytest.raises(ValueError, match="another tensor- or pipeline-parallel LLM is running"):
            LLM(str(path), dtype="float32", **kw)
    long = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    killed = []
    killer = threading.Timer(1.0, lambda: (killed.append(time.monotonic()), os.kill(pids[0], signal.SIGKILL)))
    killer.start()
    try:
        with pytest.raises(Exception, match=r"pipeline stage link .*The requests in flight failed") as err:
            llm.generate([list(range(5, 40))], long, use_tqdm=False)
        assert killed and time.monotonic() - killed[0] < 30
        print(err.value)
        with pytest.raises(Exception, match="pipeline stage link"):  # every later request, at once
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    finally:
        killer.cancel()
        llm.shutdown()
    assert not alive(pids)


def test_unsupported_options_are_refused_before_any_stage_starts(tmp_path, hf_smollm2_tokenizer):
    from models import build_checkpoint

    tok = hf_smollm2_tokenizer
    path = str(build_checkpoint("llama", tmp_path / "m", tok, len(tok)))
    before = descendants()
    cases = [
        (
            dict(enable_lora=True),
            "LoRA adapters do not run under pipeline parallelism yet; use pipeline_parallel_size=1",
        ),
        (dict(speculative={"method": "draft", "model": path}), "draft model does not run under pipeline parallelism"),
        (dict(kv_cache_dtype="f8e4m3"), "calibrates its scales .* pipeline_parallel_size=1"),
        (dict(paged_attention=False), "paged KV cache"),
        (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not divide the model's 4 attention heads"),
        (dict(pipeline_parallel_size=4), r"more stages than the model's 3 layers.*use at most 3"),
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be >= 1"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            LLM(path, dtype="float32", **{"pipeline_parallel_size": 2, **kw})
    assert descendants() <= before


@pytest.mark.parametrize(
    "argv", [["generate", "m", "-pp", "2"], ["chat", "m", "--pipeline-parallel-size", "2"], ["serve", "m", "-pp", "2"]]
)
def test_pp_flag_reaches_llm(argv):
    from pagedllm.cli.main import build_parser, command_config

    args = build_parser(argv).parse_args(argv)
    assert command_config(args).parallel.pipeline_parallel_size == 2


def test_bench_throughput_takes_pp():
    from pagedllm.cli.main import build_parser

    for given, sizes in (("2", [2]), ("1,2", [1, 2])):
        argv = ["bench", "throughput", "-pp", given]
        assert build_parser(argv).parse_args(argv).pipeline_parallel_size == sizes
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(["bench", "throughput", "-pp", "0"])


@pytest.mark.slow
def test_bench_throughput_compares_pipeline_sizes_and_profiles_the_measured_runs(
    tmp_path, hf_smollm2_tokenizer, capsys
):
    """`bench throughput -pp 1,2`: the workload at each size, one engine after the other, with
    their ratio; pp=2's bubble profile covers the measured run's steps, not the warm-up's."""
    from models import build_checkpoint
    from pagedllm.cli.main import main

    tok = hf_smollm2_tokenizer
    path = build_checkpoint("llama", tmp_path / "m", tok, len(tok))
    out = tmp_path / "t.json"
    main(
        [
            "bench",
            "throughput",
            "--model",
            str(path),
            "-pp",
            "1,2",
            "--num-requests",
            "8",
            "--max-prompt",
            "64",
            "--max-output",
            "16",
            "--runs",
            "1",
            "--peer",
            "none",
            "--sampling",
            "greedy",
            "--dtype",
            "float32",
            "--output",
            str(out),
        ]
    )
    by = json.loads(out.read_text())["pagedllm_by_pipeline_size"]
    assert list(by) == ["pp=1", "pp=2"]
    assert by["pp=1"]["output_tokens"] == by["pp=2"]["output_tokens"]
    stages = by["pp=2"]["pipeline_stages"]
    assert [s["steps"] for s in stages] == [by["pp=2"]["steps"]] * 2
    assert all(0 < s["busy_s"] < s["window_s"] for s in stages)
    assert all(0 < s["prompt_steps"] < s["steps"] and 0 < s["prompt_busy_s"] < s["busy_s"] for s in stages)
    printed = capsys.readouterr().out
    assert printed.count("a step, with prompt tokens") == 2
    assert "output tok/s by pipeline size: pp=1" in printed and "rank 1 (stage 1)" in printed


def test_serve_pp2_answers_the_openai_client_as_pp1_and_sigterm_leaves_no_process(tmp_path, hf_smollm2_tokenizer):
    """`pagedllm serve -pp 2`: the openai client's chat, streamed and not, greedy, gets pp=1's
    answer; /metrics gives each stage's KV bytes; SIGTERM ends the server and its stage process."""
    openai = pytest.importorskip("openai")
    from models import build_checkpoint
    from test_server import ServerProcess, free_port

    tok = hf_smollm2_tokenizer
    path = build_checkpoint("llama", tmp_path / "m", tok, len(tok))
    msgs = [{"role": "user", "content": "Name three colours."}]
    port = free_port()
    srv = ServerProcess(
        [
            "serve",
            str(path),
            "-pp",
            "2",
            "--dtype",
            "float32",
            "--pa-ctxt-len",
            "2048",
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
        ],
        port,
        tmp_path / "serve.log",
    )
    try:
        srv.wait_ready()
        stages = psutil.Process(srv.proc.pid).children(recursive=True)
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none")
        kw = dict(model="tiny", messages=msgs, max_tokens=16, temperature=0.0)
        whole = client.chat.completions.create(**kw).choices[0].message.content
        streamed = "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True) if c.choices
        )
        metrics = srv.metrics()
        # SIGTERM to the server and its stage at once, as `kill -- -PGID`, a terminal's Ctrl-C or a
        # service manager stopping the group sends it: the stage leaves its stop to rank 0.
        for p in [psutil.Process(srv.proc.pid), *stages]:
            p.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0, srv.log()[-3000:]
        log = srv.log()
        assert "stopped by SIGTERM" in log and "failed" not in log and "Connection closed" not in log, log[-3000:]
    finally:
        srv.stop()
    deadline = time.monotonic() + 10
    while alive([p.pid for p in stages]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive([p.pid for p in stages]), [p.pid for p in stages]
    one = LLM(str(path), dtype="float32", kv_cache_context_len=2048)
    want = one.chat(msgs, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False).outputs[0].text
    assert whole == streamed == want and want
    # /metrics: each stage's KV bytes, together the whole model's cache of the same blocks.
    stage_kv = [metrics[f'pagedllm_rank_kv_cache_bytes{{rank="{r}"}}'] for r in range(2)]
    assert all(kv > 0 for kv in stage_kv) and sum(stage_kv) == one.engine.kv_cache.nbytes
    assert metrics['pagedllm_rank_weight_bytes{rank="1"}'] > 0
