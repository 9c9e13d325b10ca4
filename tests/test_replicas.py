"""`pagedllm serve --data-parallel-size 2`: two replicas behind SGLang's gateway (sglang-router),
driven by the real openai client. Greedy answers through the gateway equal a replica's own; a
replica killed with SIGKILL mid-stream ends every request within 10 s and is restarted and used
again; SIGTERM leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from models import build_checkpoint

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install 'pagedllm[router]')")
pytest.importorskip("peft")
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")
from lora_adapters import make_adapter  # noqa: E402

from pagedllm.server.replicas import free_port, wait_healthy  # noqa: E402


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _workers(gateway: str) -> dict[str, bool]:
    return {w["url"]: w["is_healthy"] for w in _get(gateway + "/workers")["workers"]}


def _served(url: str) -> float:
    """Chat requests a replica has finished (its own /metrics)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pagedllm_requests_finished_total")
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, hf_smollm2_tokenizer):
    tok = hf_smollm2_tokenizer
    root = tmp_path_factory.mktemp("replicas")
    base = build_checkpoint("llama", root / "base", tok, len(tok))
    adapter = make_adapter(base, root / "a0", 1, 8, 16, False, ["q_proj", "v_proj"])
    port = free_port()
    env = dict(os.environ, PAGEDLLM_FLEET_LOG_DIR=str(root / "logs"))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedllm",
            "serve",
            str(base),
            "--served-model-name",
            "base",
            "--dtype",
            "float32",
            "--pa-gpu-mem",
            "32",
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--lora-modules",
            f"a0={adapter}",
            "--data-parallel-size",
            "2",
            "--port",
            str(port),
            "--routing",
            "round_robin",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(root / "fleet.err", "wb"),
    )
    gateway = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(gateway, proc, 300, path="/readiness")
        yield proc, gateway, root
    finally:
        if proc.poll() is None:  # the children first: once serve is gone they are init's
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()


def _replicas(gateway: str) -> list[str]:
    urls = sorted(_workers(gateway))
    assert len(urls) == 2, urls
    return urls


def _answers(base_url: str) -> list:
    c = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    # Bounded answers: a random tiny model would fill an open string up to max_tokens.
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "boolean"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    out = [
        c.chat.completions.create(model="base", messages=msgs, max_tokens=12, temperature=0).choices[0].message.content,
        c.completions.create(model="base", prompt="Once upon a time", max_tokens=12, temperature=0).choices[0].text,
        c.chat.completions.create(
            model="base",
            messages=msgs,
            tools=[tool],
            max_tokens=60,
            temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        .choices[0]
        .message.tool_calls[0]
        .function.arguments,
        c.chat.completions.create(
            model="base",
            messages=msgs,
            max_tokens=60,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        )
        .choices[0]
        .message.content,
        c.completions.create(model="a0", prompt="Once upon a time", max_tokens=12, temperature=0).choices[0].text,
        c.responses.create(model="base", input="Once upon a time", max_output_tokens=12, temperature=0).output_text,
    ]
    assert json.loads(out[2])["city"] in ("Paris", "Rome"), out[2]  # the constrained answers are JSON
    assert isinstance(json.loads(out[3])["answer"], bool), out[3]
    return out


@pytest.mark.slow
def test_gateway_answers_equal_a_replicas(fleet):
    _, gateway, _ = fleet
    replica = _replicas(gateway)[0]
    assert _get(replica + "/server_info")["served_model_name"] == "base"
    assert _get(replica + "/model_info")["architectures"] == ["LlamaForCausalLM"]
    assert {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(_get(replica + "/get_load")[0])
    direct = _answers(replica)
    for _ in range(2):  # round robin: both replicas answer through the gateway
        assert _answers(gateway) == direct


@pytest.mark.slow
def test_kill9_one_replica_under_streams(fleet):
    proc, gateway, _ = fleet
    urls = _replicas(gateway)
    victim = urls[0]
    port = int(victim.rsplit(":", 1)[1])
    pid = next(
        p.pid
        for p in psutil.Process(proc.pid).children(recursive=True)
        if any(c.laddr.port == port and c.status == "LISTEN" for c in p.net_connections())
    )
    c = openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0, timeout=60)
    ended: list[tuple[str, float]] = []
    killed_at: list[float] = []

    def stream(i: int) -> None:
        try:
            s = c.chat.completions.create(
                model="base",
                messages=[{"role": "user", "content": f"Count {i}"}],
                max_tokens=300,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in s:
                pass
            ended.append(("answer", time.monotonic()))
        except Exception as e:  # an error event or a failed request: ended, not hung
            ended.append((type(e).__name__, time.monotonic()))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    os.kill(pid, signal.SIGKILL)
    killed_at.append(time.monotonic())
    for t in threads:
        t.join(60)
    assert len(ended) == 32, "a request never ended"
    assert max(t for _, t in ended) - killed_at[0] < 10, ended
    # Round robin put half the streams on the live replica: they answer in full.
    assert sum(kind == "answer" for kind, _ in ended) >= 16, ended
    # Out of routing within 5 s: requests sent now all land on the live replica and succeed.
    # (A tiny model restarts within seconds: it may be back before a check sees it down, then a
    # new process answers on its port.)
    deadline, seen_down = time.monotonic() + 5, False
    while not seen_down and time.monotonic() < deadline:
        seen_down = _workers(gateway).get(victim) is False
        time.sleep(0.1)
    restarted = any(
        p.pid != pid and any(c.laddr.port == port and c.status == "LISTEN" for c in p.net_connections())
        for p in psutil.Process(proc.pid).children(recursive=True)
    )
    assert seen_down or restarted, "the gateway still routes to the killed replica"
    for i in range(4):
        c.completions.create(model="base", prompt=f"after {i}", max_tokens=4, temperature=0)
    # Restarted by serve, back in routing, and used again.
    deadline = time.monotonic() + 120
    while not _workers(gateway).get(victim) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _workers(gateway).get(victim), "the restarted replica is not back in routing"
    before = _served(victim)
    for i in range(4):
        c.completions.create(model="base", prompt=f"again {i}", max_tokens=4, temperature=0)
    assert _served(victim) > before, "the restarted replica got no traffic"


def test_sigterm_leaves_nothing_running(fleet):
    proc, _, _ = fleet
    family = [proc, *psutil.Process(proc.pid).children(recursive=True)]
    assert len(family) >= 4  # serve, two replicas, the gateway
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    gone, alive = psutil.wait_procs([p for p in family if p is not proc], timeout=10)
    assert not alive, alive
