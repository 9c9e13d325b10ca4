"""Lazily allocated KV pools (issue 14): what an unwritten slot holds never reaches an output,
the free list reuses the most recently freed block, the trace reports ceiling and committed
bytes, and a request whose logits are not finite fails on its own."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.sequence import Sequence
from pagedllm.kv import cache as kv_cache
from pagedllm.outputs import RequestFailedError
from models import build_checkpoint

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama(tmp_path_factory, hf_smollm2_tokenizer):
    tok = hf_smollm2_tokenizer
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama-lazy"), tok, len(tok))


# -- never read an unwritten slot ----------------------------------------------------------
def _garbage(shape, dtype, device):
    """What an unwritten page might hold, at its worst: NaN everywhere (int8 has no NaN: its
    largest value, so a read of it would show through the scales or the output)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if dtype == torch.int8:
        return t.fill_(127)
    if dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).fill_(0x7F)  # e4m3fn's NaN
        return t
    return t.fill_(float("nan"))


def _zeros(shape, dtype, device):
    return torch.zeros(shape, dtype=dtype, device=device)


def _scenarios(llm: LLM) -> list:
    """Exactness (a mixed batch, chunked prefill), preemption (a cache far too small), prefix
    cache (shared prefixes, full-block hits and partial-block copies), a fork (n=3 sampled,
    copy-on-write) and a last batch that reuses blocks freed by all of the above."""
    g = torch.Generator().manual_seed(3)
    vocab = llm.engine.model_config.vocab_size
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    shared = rand(29)  # 3 full blocks of 8 and 5 tokens of a fourth
    batches = [
        [rand(n) for n in (1, 7, 23, 40, 61, 9)],
        [shared + rand(n) for n in (1, 4, 12)],
        [shared[:27] + rand(3), shared + rand(2)],  # partial-block matches
    ]
    outs = [[o.token_ids for o in llm.generate(b, greedy, use_tqdm=False)] for b in batches]
    fork = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    outs.append([c.token_ids for c in llm.generate([shared + rand(6)], fork, use_tqdm=False)[0].outputs])
    outs.append([o.token_ids for o in llm.generate(batches[0][::-1], greedy, use_tqdm=False)])
    return outs


PATHS = [
    ("native", "auto"),
    ("native", "int8"),
    ("native", "f8e4m3"),
    ("torch", "auto"),
    ("torch", "int8"),
    ("torch", "f8e4m3"),
    ("contiguous", "auto"),
    ("contiguous", "int8"),
    ("contiguous", "f8e4m3"),
]


@pytest.mark.parametrize("path,kv_dtype", PATHS)
def test_nan_filled_pools_give_the_zero_filled_outputs(llama, monkeypatch, path, kv_dtype):
    if path == "torch":  # the PyTorch gather path instead of the native decode kernel
        monkeypatch.setattr("pagedllm.attention.paged.cpu_kernels", lambda: None)
    # The CPU, where pools are lazily allocated (elsewhere they are zero-filled as before).
    kw = dict(
        device="cpu",
        dtype="float32",
        block_size=8,
        kv_cache_context_len=160,
        max_num_batched_tokens=32,
        kv_cache_dtype=kv_dtype,
        paged_attention=path != "contiguous",
        max_model_len=256,
    )
    runs = {}
    for name, fill in (("zeros", _zeros), ("nan", _garbage)):
        monkeypatch.setattr(kv_cache, "empty_pool", fill)
        llm = LLM(str(llama), **kw)
        eng = llm.engine
        decode = eng.kv_cache_trace().decode_attention
        assert decode.startswith(
            {"native": "torch-paged with the native", "torch": "torch-paged: all", "contiguous": "torch-contiguous"}[
                path
            ]
        ), decode
        runs[name] = _scenarios(llm)
        assert eng.scheduler.num_preemptions > 0
        if path != "contiguous":
            assert eng.block_manager.stats.hits > 0 and eng.block_manager.stats.partial_hits > 0
            if name == "nan":  # the garbage really was there, outside the null block
                assert eng.kv_cache.data.view(torch.uint8)[:, :, 1:].ne(0).any()
    assert runs["nan"] == runs["zeros"]


# -- the free list --------------------------------------------------------------------------
def _seq(n: int) -> Sequence:
    return Sequence("r", list(range(n)), SamplingParams())


def test_free_list_hands_out_the_most_recently_freed_block_first():
    bm = BlockManager(64, 4)
    a, b = _seq(8), _seq(8)
    bm.grow(a, 8)
    bm.grow(b, 8)
    assert a.block_table == [1, 2] and b.block_table == [3, 4] and bm.num_touched == 4
    bm.free(a)
    c = _seq(4)
    bm.grow(c, 4)
    assert c.block_table == [1]  # a's blocks come back before any untouched one
    for _ in range(50):  # a long run of short requests cycles through the same few blocks
        s = _seq(12)
        bm.grow(s, 12)
        bm.free(s)
    assert bm.num_touched == 6  # the peak in use: b's 2, c's 1 and s's 3
    bm.check_invariants([b, c])


def test_trace_reports_the_ceiling_and_the_committed_bytes(llama):
    llm = LLM(str(llama), device="cpu", dtype="float32", block_size=8, kv_cache_memory_mb=64)
    eng = llm.engine
    spec = eng.kv_spec
    tr = llm.kv_cache_trace()
    assert tr.memory_mb > 60 and tr.blocks_touched == 0
    assert tr.committed_mb == pytest.approx(spec.bytes_per_block / 2**20)  # the null block
    assert "estimated" in tr.committed_how
    llm.generate([list(range(100, 150))] * 2, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    tr = llm.kv_cache_trace()
    # 56 tokens = 7 blocks each (admitted in the same step, so nothing is shared yet)
    assert tr.blocks_touched == 14
    assert tr.committed_mb == pytest.approx(15 * spec.bytes_per_block / 2**20)


# -- non-finite logits fail the request -----------------------------------------------------
POISON = 4242  # the token whose embedding gets one NaN


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory, hf_smollm2_tokenizer):
    """The random Llama with one NaN in one weight: the embedding row of token POISON."""
    from safetensors.torch import load_file, save_file

    tok = hf_smollm2_tokenizer
    path = build_checkpoint("llama", tmp_path_factory.mktemp("llama-nan"), tok, len(tok))
    f = path / "model.safetensors"
    w = load_file(f)
    w["model.embed_tokens.weight"][POISON, 5] = float("nan")
    save_file(w, f, metadata={"format": "pt"})
    return path


CLEAN = [list(range(300, 340)), list(range(700, 712))]
BAD = list(range(500, 520)) + [POISON] + list(range(520, 530))
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_nan_weight_fails_its_request_and_the_batch_goes_on(poisoned):
    llm = LLM(str(poisoned), dtype="float32", kv_cache_memory_mb=16)
    want = [o.token_ids for o in llm.generate(CLEAN, GREEDY, use_tqdm=False)]
    with pytest.raises(RequestFailedError) as e:
        llm.generate([CLEAN[0], BAD, CLEAN[1]], GREEDY, use_tqdm=False)
    msg = str(e.value)
    assert "non-finite logits" in msg and poisoned.name in msg and "step" in msg, msg
    outs = e.value.outputs
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].error and outs[1].token_ids == [] and outs[1].text == ""
    assert [outs[0].token_ids, outs[2].token_ids] == want
    with pytest.raises(RequestFailedError, match="non-finite"):
        list(llm.stream(BAD, GREEDY))
    # The failed request's blocks (NaN K/V in them) went back to the free list: reusing them
    # must not change anyone's answer, and nothing of it stays in the prefix cache.
    assert [o.token_ids for o in llm.generate(CLEAN, GREEDY, use_tqdm=False)] == want
    bm = llm.engine.block_manager
    assert bm.num_used_blocks == 0 and not llm.engine.requests
    bm.check_invariants([])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nan_weight_server_answers_an_error_body_and_keeps_serving(poisoned):
    openai = pytest.importorskip("openai")
    uvicorn = pytest.importorskip("uvicorn")
    from pagedllm.server.app import ServerConfig, create_app

    llm = LLM(str(poisoned), dtype="float32", kv_cache_memory_mb=16)
    want = llm.generate([CLEAN[0]], GREEDY, use_tqdm=False)[0].text
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(llm, ServerConfig(model_name="m")), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/v1"
        client = None  # one per event loop: asyncio.run below is called twice
        kw = dict(model="m", max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})

        async def bad_plain():
            with pytest.raises(openai.InternalServerError) as e:
                await client.completions.create(prompt=BAD, **kw)
            err = e.value.body
            assert err["type"] == "server_error" and "non-finite logits" in err["message"], err
            return "error body"

        async def bad_stream():
            got = []
            with pytest.raises(openai.APIError, match="non-finite logits"):
                async for chunk in await client.completions.create(prompt=BAD, stream=True, **kw):
                    got.append(chunk.choices[0].finish_reason)
            assert "stop" not in got and "error" not in got
            return "error event"

        async def good():
            r = await client.completions.create(prompt=CLEAN[0], **kw)
            assert r.choices[0].finish_reason == "length"
            return r.choices[0].text

        async def run(*calls):
            nonlocal client
            async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
                return await asyncio.gather(*(c() for c in calls))

        res = asyncio.run(run(bad_plain, good, bad_stream, good))
        assert res[0] == "error body" and res[2] == "error event"
        assert res[1] == want == res[3]
        assert asyncio.run(run(good)) == [want]  # still serving afterwards
    finally:
        server.should_exit = True
        thread.join(30)
