"""`pagedllm serve` driven by the real `openai` client (and raw HTTP for the bad requests).

One server process for the module, on a free loopback port, with the default model
in float32 with dequantized weights (batched and single-sequence greedy answers then agree
exactly, and answers do not hang on int8-activation near-ties; tests/test_smollm2.py covers those).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

API_KEY = "sk-test-key"
QUESTION = "What is the capital of France? Answer in one sentence."  # (bare, its first token is a near tie)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How long a server may take to start: generous, for a loaded machine (PAGEDLLM_TEST_START_TIMEOUT).
START_TIMEOUT = float(os.environ.get("PAGEDLLM_TEST_START_TIMEOUT", "900"))


class ServerStartError(Exception):
    """A server exited during its start, or did not answer /health within the budget."""


class ServerProcess:
    """A `pagedllm ...` process that serves HTTP; logs go to a file for post-mortems."""

    def __init__(self, args: list[str], port: int, log_path: Path, api_key: str | None = None) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.cli.main", *args], stdout=self._log, stderr=subprocess.STDOUT, env=env
        )

    def wait_ready(self, timeout: float = START_TIMEOUT) -> float:
        """Seconds until /health answers 200, the server's own readiness signal (its port is open
        from the start, so a poll during the model's load waits in the backlog, then retries). A
        process that exits stops the wait at once; either failure raises ServerStartError with
        the log's tail."""
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"server exited ({self.proc.returncode}) during its start; its log ends:\n{self.log()[-3000:]}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.time() - t0
            except httpx.HTTPError:
                pass
            if time.time() - t0 > timeout:
                raise ServerStartError(
                    f"server not ready after {timeout:.0f} s (PAGEDLLM_TEST_START_TIMEOUT); "
                    f"its log ends:\n{self.log()[-3000:]}"
                )
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith("pagedllm_") or line.startswith("process_"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class Started:
    """A module's server, started once: where the start fails (an exit, or a start slower than
    the budget), the first test that needs it fails with why and the module's other tests skip,
    rather than every test erroring on the same module fixture."""

    def __init__(self, srv: ServerProcess) -> None:
        self.srv = srv
        self.error: str | None = None
        self._reported = False
        try:
            srv.wait_ready()
        except ServerStartError as e:
            self.error = str(e)

    def get(self) -> ServerProcess:
        if self.error is None:
            return self.srv
        if not self._reported:
            self._reported = True
            pytest.fail(self.error, pytrace=False)
        pytest.skip("this module's server did not start (the first test that needed it failed with why)")

    def __getattr__(self, name: str):
        # Modules that use the fixture's value as the server itself (`.url`, `.headers`, `.log()`)
        # get it through `.get()`, so a failed start still fails one test and skips the rest.
        return getattr(self.get(), name)


def serving(tmp_path_factory, name: str, args: list[str]):
    """A `pagedllm serve` process for a test module, as a `Started` (a generator for a module
    fixture; a function fixture hands out `.get()`): no traceback may reach its log."""
    port = free_port()
    srv = ServerProcess(["serve", "--port", str(port), *args], port, tmp_path_factory.mktemp(name) / "server.log")
    started = Started(srv)
    try:
        yield started
    finally:
        srv.stop()
        assert "Traceback" not in srv.log(), srv.log()[-5000:]


# The real Qwen2.5-Coder-0.5B file, for the checks a tiny model cannot show (tool calls, FIM).
QWEN_05B = Path.home() / ".cache/pagedllm/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def serving_qwen(tmp_path_factory, name: str):
    """`serving` on the real Qwen2.5-Coder-0.5B file, served as "qwen"; skips where it is absent."""
    if not QWEN_05B.is_file():
        pytest.skip(f"{QWEN_05B} is not here")
    yield from serving(
        tmp_path_factory,
        name,
        [str(QWEN_05B), "--served-model-name", "qwen", "--max-model-len", "2048", "--max-seqs", "4"],
    )


@pytest.fixture(scope="module")
def started_server(tmp_path_factory, smollm2_gguf_path):
    port = free_port()
    srv = ServerProcess(
        [
            "serve",
            "--port",
            str(port),
            "--api-key",
            API_KEY,
            "--pa-gpu-mem",
            "256",
            "--max-model-len",
            "1024",
            "--max-seqs",
            "40",
            "--dtype",
            "float32",
            "--dequantize-weights",
            "--log-level",
            "info",
        ],
        port,
        tmp_path_factory.mktemp("server") / "server.log",
        API_KEY,
    )
    started = Started(srv)
    try:
        yield started
    finally:
        code = srv.stop()
        log = srv.log()
        if started.error is None:
            # uvicorn shuts down cleanly, then re-raises the SIGINT: 130 is the normal code
            assert code in (0, 130), f"server exit code {code}:\n{log[-3000:]}"
            assert "Traceback" not in log, log[-5000:]
            assert "engine thread stopped" in log


@pytest.fixture
def server(started_server):
    return started_server.get()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(client, content: str = QUESTION, **kw):
    return client.chat.completions.create(model="default", messages=[{"role": "user", "content": content}], **kw)


def wait_idle(server: ServerProcess, timeout: float = 10) -> dict[str, float]:
    t0 = time.time()
    while True:
        m = server.metrics()
        if m["pagedllm_kv_blocks_used"] == 0 and m["pagedllm_num_requests_running"] == 0:
            return m
        if time.time() - t0 > timeout:
            raise AssertionError(f"server still busy: {m}")
        time.sleep(0.05)


# -- happy paths -------------------------------------------------------------------------------


def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}  # no key needed
    models = client.models.list()
    assert [m.id for m in models.data] == ["default"]


def test_chat_completion_with_usage(client):
    r = chat(client, max_tokens=12, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and "Paris" in msg.content
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 5 and 1 <= u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    check_usage_rates(u.prompt_tokens, u.completion_tokens, u.model_extra)  # mistral.rs's figures


def check_usage_rates(prompt: int, completion: int, extra: dict) -> None:
    """mistral.rs's timing figures agree with each other and with the token counts."""
    t, tp, tc = extra["total_time_sec"], extra["total_prompt_time_sec"], extra["total_completion_time_sec"]
    assert tp > 0 and tc >= 0 and t == pytest.approx(tp + tc)
    assert extra["avg_prompt_tok_per_sec"] == pytest.approx(prompt / tp)
    assert extra["avg_tok_per_sec"] == pytest.approx((prompt + completion) / t)
    if tc > 0:
        assert extra["avg_compl_tok_per_sec"] == pytest.approx(completion / tc)


def test_max_completion_tokens_and_logprobs(client):
    r = chat(
        client, max_completion_tokens=4, temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
    assert "".join(t.token for t in content) == r.choices[0].message.content


def test_echo_logprobs_equal_transformers_log_softmax(client, hf_smollm2_model, hf_smollm2_tokenizer):
    """The module's server runs dequantized float32 weights: logprobs compared with transformers
    to 2e-3 need the weights transformers uses, not the quantized GGUF blocks a default server keeps."""
    import torch

    text = "The quick brown fox jumps over the lazy dog. Paris is the capital of"
    ids = hf_smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_smollm2_model(torch.tensor([ids])).logits[0].float(), -1)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    # max_tokens 0: only the prompt, scored (what lm-eval's loglikelihood reads)
    r = client.completions.create(model="default", prompt=ids, max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    got = torch.tensor(lp.token_logprobs[1:])
    assert (got - want).abs().max().item() < 2e-3, (got - want).abs().max()
    assert "".join(lp.tokens) == r.choices[0].text == hf_smollm2_tokenizer.decode(ids)
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    # with generation: the prompt's entries first, then the new tokens', streamed the same
    kw = dict(model="default", prompt=text, max_tokens=3, echo=True, logprobs=1, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    assert whole.text.startswith(text) and len(whole.logprobs.tokens) == len(ids) + 3
    assert abs(whole.logprobs.token_logprobs[len(ids) - 1] - want[-1].item()) < 2e-3
    parts = list(client.completions.create(stream=True, **kw))
    streamed = [t for c in parts if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert "".join(c.choices[0].text for c in parts if c.choices) == whole.text
    assert len(streamed) == len(whole.logprobs.token_logprobs) and streamed[0] is None


def test_max_tokens_past_context_gets_openai_message(server):
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers=server.headers,
        timeout=30,
        json={"messages": MSG, "max_tokens": 10**9},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert err["message"].startswith("This model's maximum context length is 1024 tokens. However, you requested ")


def test_stream_equals_non_stream_for_same_seed(client):
    kw = dict(
        max_tokens=12,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1},
    )
    whole = chat(client, **kw)
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_n2_streaming_and_not(client):
    r = chat(client, n=2, max_tokens=6, temperature=1.0, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1]
    streamed = {0: "", 1: ""}
    finished = set()
    for c in chat(client, n=2, max_tokens=6, temperature=1.0, seed=5, stream=True):
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1}
    assert streamed == {c.index: c.message.content for c in r.choices}


def test_text_completion_n2_and_stream(client):
    r = client.completions.create(model="default", prompt="The capital of France is", max_tokens=6, temperature=0, n=2)
    assert r.object == "text_completion" and len(r.choices) == 2
    assert r.choices[0].text == r.choices[1].text  # greedy: both choices agree
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="default", prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    )
    assert text == r.choices[0].text
    assert 2 <= r.usage.completion_tokens <= 12  # both choices count


def test_completion_batch_of_prompts_and_token_ids(client):
    r = client.completions.create(
        model="default",
        prompt=["Hello", "The sky is"],
        max_tokens=3,
        temperature=0,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12
    r2 = client.completions.create(model="default", prompt=[504, 3575, 282], max_tokens=2, temperature=0)
    assert r2.usage.prompt_tokens == 3


def test_stop_strings(client):
    prompt = "Write the numbers from one to ten in words: one, two,"
    full = (
        client.completions.create(
            model="default", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    want = full[: full.index(stop)]
    r = client.completions.create(
        model="default",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stop=[stop, "never-appears"],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="default",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    parts = [c.choices[0] for c in streamed if c.choices]
    assert "".join(p.text for p in parts) == want
    assert parts[-1].finish_reason == "stop"


def test_32_concurrent_streaming_clients(server, client):
    prompts = ["What is the capital of France?", "Name a color.", "Say hello.", "Count to three."]
    kw = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    want = {p: chat(client, p, **kw).choices[0].message.content for p in prompts}

    async def one(ac, i: int) -> tuple[str, str, str | None, int]:
        p = prompts[i % len(prompts)]
        stream = await ac.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": p}],
            stream=True,
            stream_options={"include_usage": True},
            **kw,
        )
        text, reason, tokens = "", None, 0
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                reason = c.choices[0].finish_reason or reason
            if c.usage:
                tokens = c.usage.completion_tokens
        return p, text, reason, tokens

    async def main():
        ac = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*[one(ac, i) for i in range(32)])
        finally:
            await ac.close()

    results = asyncio.run(main())
    assert len(results) == 32
    for p, text, reason, tokens in results:
        assert reason == "length" and tokens == 8
        assert text == want[p], (p, text, want[p])
    m = wait_idle(server)
    assert m["pagedllm_time_to_first_token_seconds_count"] >= 36
    assert m["pagedllm_inter_token_latency_seconds_count"] > 0


# -- disconnects ---------------------------------------------------------------------------------


# As many tokens as the context allows: no machine finishes them before the disconnect is seen,
# and the checks count tokens, never seconds. The chat prompt (~40 tokens) plus these must fit
# in the server's 1024-token context, or the request gets OpenAI's context_length_exceeded 400.
LONG_MAX_TOKENS = 960


def test_streaming_client_disconnect_aborts_and_frees_blocks(server):
    before = server.metrics()
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": LONG_MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(headers=server.headers, timeout=60) as c:
        with c.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            # Held in a name: a `for` over r.iter_lines() itself would close the generator at the
            # break, and with it the connection, before the server is asked whether it is busy.
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: ") and '"content":"' in line:
                    seen += 1
                if seen >= 4:
                    break
            busy = server.metrics()
            assert busy["pagedllm_kv_blocks_used"] > 0 and busy["pagedllm_num_requests_running"] == 1
    # leaving the block closed the connection mid-stream
    after = wait_idle(server, timeout=5)
    assert after["pagedllm_requests_aborted_total"] == before["pagedllm_requests_aborted_total"] + 1
    # the abort happened at the first step boundary after the server noticed
    assert after['pagedllm_abort_delay_steps_bucket{le="1.0"}'] == after["pagedllm_abort_delay_steps_count"]
    generated = after["pagedllm_generation_tokens_total"] - before["pagedllm_generation_tokens_total"]
    assert 4 <= generated < LONG_MAX_TOKENS


def test_non_streaming_client_disconnect_aborts(server):
    """The client hangs up once the server reports the request running: no client timeout, so
    the test does not depend on how fast tokens come."""
    before = server.metrics()
    body = json.dumps(
        {
            "model": "default",
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": LONG_MAX_TOKENS,
            "ignore_eos": True,
        }
    ).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: "
            + host.encode()
            + b"\r\nContent-Type: application/json\r\nAuthorization: Bearer "
            + API_KEY.encode()
            + b"\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        t0 = time.time()
        while server.metrics()["pagedllm_num_requests_running"] != 1:
            assert time.time() - t0 < 60, "the request never started"
            time.sleep(0.02)
    finally:
        sock.close()
    after = wait_idle(server, timeout=30)
    assert after["pagedllm_requests_aborted_total"] == before["pagedllm_requests_aborted_total"] + 1
    assert after["pagedllm_kv_blocks_free"] == after["pagedllm_kv_blocks_total"]
    assert after["pagedllm_generation_tokens_total"] - before["pagedllm_generation_tokens_total"] < LONG_MAX_TOKENS


# -- bad requests --------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
CHAT, COMPL = "/v1/chat/completions", "/v1/completions"
BAD_REQUESTS = {
    "malformed_json": (CHAT, b'{"messages": [', 400),
    "body_not_object": (CHAT, b"[1, 2, 3]", 400),
    "empty_body": (CHAT, b"", 400),
    "missing_messages": (CHAT, {"model": "default"}, 400),
    "messages_not_list": (CHAT, {"messages": "hi"}, 400),
    "messages_empty": (CHAT, {"messages": []}, 400),
    "unknown_role": (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    "content_wrong_type": (CHAT, {"messages": [{"role": "user", "content": 42}]}, 400),
    "image_content": (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
        400,
    ),
    "temperature_string": (CHAT, {"messages": MSG, "temperature": "hot"}, 400),
    "temperature_negative": (CHAT, {"messages": MSG, "temperature": -1}, 400),
    "temperature_nan": (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400),
    "top_p_zero": (CHAT, {"messages": MSG, "top_p": 0}, 400),
    "top_p_above_one": (CHAT, {"messages": MSG, "top_p": 1.5}, 400),
    "top_k_negative": (CHAT, {"messages": MSG, "top_k": -5}, 400),
    "min_p_above_one": (CHAT, {"messages": MSG, "min_p": 2}, 400),
    "presence_penalty_out_of_range": (CHAT, {"messages": MSG, "presence_penalty": 5}, 400),
    "frequency_penalty_bool": (CHAT, {"messages": MSG, "frequency_penalty": True}, 400),
    "repetition_penalty_zero": (CHAT, {"messages": MSG, "repetition_penalty": 0}, 400),
    "n_too_large": (CHAT, {"messages": MSG, "n": 1000}, 400),
    "n_zero": (CHAT, {"messages": MSG, "n": 0}, 400),
    "max_tokens_zero": (CHAT, {"messages": MSG, "max_tokens": 0}, 400),
    "max_tokens_string": (CHAT, {"messages": MSG, "max_tokens": "ten"}, 400),
    "max_tokens_fraction": (CHAT, {"messages": MSG, "max_tokens": 1.5}, 400),
    "seed_string": (CHAT, {"messages": MSG, "seed": "abc"}, 400),
    "top_logprobs_too_many": (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400),
    "top_logprobs_without_logprobs": (CHAT, {"messages": MSG, "top_logprobs": 2}, 400),
    "stop_empty_string": (CHAT, {"messages": MSG, "stop": [""]}, 400),
    "stop_wrong_type": (CHAT, {"messages": MSG, "stop": 5}, 400),
    "logit_bias_outside_vocab": (CHAT, {"messages": MSG, "logit_bias": {"999999": -100}}, 400),
    "logit_bias_not_an_id": (CHAT, {"messages": MSG, "logit_bias": {"abc": 5}}, 400),
    "logit_bias_above_100": (CHAT, {"messages": MSG, "logit_bias": {"50": 101}}, 400),
    "tools_unknown_choice": (
        CHAT,
        {
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
    ),
    "stream_options_without_stream": (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, 400),
    "bad_input_while_streaming": (CHAT, {"messages": MSG, "stream": True, "temperature": -1}, 400),
    "context_too_long": (CHAT, {"messages": [{"role": "user", "content": "word " * 2000}]}, 400),
    "never_fits_kv_cache": (CHAT, {"messages": MSG, "n": 40, "max_tokens": 1000}, 400),
    "prompt_missing": (COMPL, {"model": "default"}, 400),
    "prompt_empty": (COMPL, {"prompt": ""}, 400),
    "prompt_wrong_type": (COMPL, {"prompt": {"text": "hi"}}, 400),
    "prompt_token_out_of_vocab": (COMPL, {"prompt": [10**9]}, 400),
    "max_tokens_zero_without_echo": (COMPL, {"prompt": "hi", "max_tokens": 0}, 400),
    "logprobs_too_many": (COMPL, {"prompt": "hi", "logprobs": 99}, 400),
    "best_of": (COMPL, {"prompt": "hi", "best_of": 3}, 400),
    "body_too_large": (COMPL, {"prompt": "a" * (5 * 2**20)}, 413),
    "unknown_route": ("/v1/nothing", {"prompt": "hi"}, 404),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_request_gets_openai_error(server, name):
    path, body, status = BAD_REQUESTS[name]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{server.url}{path}", content=raw, timeout=30, headers={**server.headers, "Content-Type": "application/json"}
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and "Traceback" not in r.text
    if name == "context_too_long":
        assert err["code"] == "context_length_exceeded"


def test_wrong_method_and_server_keeps_serving(server, client):
    r = httpx.get(f"{server.url}/v1/chat/completions", headers=server.headers)
    assert r.status_code == 405 and r.json()["error"]["message"]
    assert "Paris" in chat(client, max_tokens=12, temperature=0).choices[0].message.content
    wait_idle(server)


def test_api_key_required_everywhere_but_health(server):
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(f"{server.url}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{server.url}{CHAT}", json={"messages": MSG}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_metrics_names(server, tmp_path, hf_smollm2_tokenizer):
    m = server.metrics()
    for name in (
        "pagedllm_num_requests_running",
        "pagedllm_num_requests_waiting",
        "pagedllm_kv_blocks_used",
        "pagedllm_kv_blocks_cached",
        "pagedllm_prefix_cache_hit_rate",
        "pagedllm_preemptions_total",
        "pagedllm_prompt_tokens_total",
        "pagedllm_generation_tokens_total",
        "pagedllm_time_to_first_token_seconds_count",
        "pagedllm_inter_token_latency_seconds_count",
        "process_resident_memory_bytes",
        "pagedllm_kv_blocks_touched",
        "pagedllm_kv_blocks_peak_used",
    ):
        assert name in m, name
    assert m["pagedllm_prompt_tokens_total"] > 0 and m["pagedllm_generation_tokens_total"] > 0
    assert 0 < m["pagedllm_kv_blocks_peak_used"] <= m["pagedllm_kv_blocks_touched"] <= m["pagedllm_kv_blocks_total"]

    # The values against the engine's own state, which only an in-process server lets a test read:
    # a small random Llama whose KV cache (48 blocks of 8) is far below what 12 requests need at
    # once (it preempts), their prompts sharing 60 tokens (prefix-cache hits).
    import threading
    from types import SimpleNamespace

    import uvicorn
    from models import build_checkpoint

    from pagedllm import LLM
    from pagedllm.server.app import ServerConfig, create_app

    path = build_checkpoint("llama", tmp_path, hf_smollm2_tokenizer, len(hf_smollm2_tokenizer))
    llm = LLM(
        str(path), dtype="float32", block_size=8, kv_cache_context_len=384, max_num_batched_tokens=64, prefix_cache_n=4
    )
    port = free_port()
    inproc = uvicorn.Server(
        uvicorn.Config(create_app(llm, ServerConfig(model_name="m")), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=inproc.run, daemon=True)
    thread.start()
    try:
        while not inproc.started:
            assert thread.is_alive()
            time.sleep(0.05)
        shared = list(range(100, 160))
        bodies = [
            {
                "model": "m",
                "prompt": shared + list(range(300 + 11 * i, 300 + 11 * i + 5 + 7 * i)),
                "max_tokens": 24,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            for i in range(12)
        ]

        async def send_all():
            async with httpx.AsyncClient(timeout=300) as c:
                rs = await asyncio.gather(*[c.post(f"http://127.0.0.1:{port}/v1/completions", json=b) for b in bodies])
            assert all(r.status_code == 200 for r in rs), [r.text for r in rs]

        asyncio.run(send_all())
        got = wait_idle(
            SimpleNamespace(
                metrics=lambda: ServerProcess.metrics(SimpleNamespace(url=f"http://127.0.0.1:{port}", headers={}))
            )
        )
        eng = llm.engine  # idle: the engine thread no longer touches it
        bm = eng.block_manager
        assert eng.scheduler.num_preemptions > 0 and bm.num_cached_blocks > 0 and bm.stats.hit_rate > 0
        assert got["pagedllm_preemptions_total"] == eng.scheduler.num_preemptions
        assert got["pagedllm_kv_blocks_cached"] == bm.num_cached_blocks
        assert got["pagedllm_prefix_cache_hit_rate"] == pytest.approx(bm.stats.hit_rate, rel=1e-9)
        assert got["pagedllm_kv_blocks_free"] == bm.num_free_blocks
        assert got["pagedllm_kv_blocks_touched"] == bm.num_touched
        assert got["pagedllm_kv_blocks_peak_used"] == bm.peak_used
        # Every request's queue time (arrival to its first scheduled step) is part of its TTFT; with
        # 64 tokens a step, most of the 12 wait behind the others.
        assert got["pagedllm_request_queue_time_seconds_count"] == 12
        assert 0 < got["pagedllm_request_queue_time_seconds_sum"] < got["pagedllm_time_to_first_token_seconds_sum"]
    finally:
        inproc.should_exit = True
        thread.join(60)
