"""Hostile input against `pagedllm serve`: no one request may crash, stall or exhaust the server.

One server process serves the default model from a copy of its GGUF whose chat template turns
hostile on three trigger messages (a malicious file's template only has to pass the check at
load). Every attack below runs against it; the last test checks that it still answers, holds
no request and no KV block, and never restarted. The attacks are issue 30's: grammar chains
that overflowed the compiler's stack (SIGSEGV), a 4 MiB prompt tokenized on the event loop,
templates without time or memory bounds, JSON that got 500s, connections that never timed out.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from pathlib import Path

import pytest

from test_server import serving  # noqa: E402  (tests/ is on sys.path, as test_tools.py uses it)

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
gguf = pytest.importorskip("gguf")

CHAT = "/v1/chat/completions"
HEADER_TIMEOUT_S = 2
# Each hostile template, as a branch taken only when the last message is its trigger.
HOSTILE = {
    "HOSTILE-REPEAT": "{{ 'a' * 10**10 }}",
    "HOSTILE-LOOPS": "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}",
    "HOSTILE-DOUBLING": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
}
LIMIT_WORDS = {"HOSTILE-REPEAT": "repetition", "HOSTILE-LOOPS": "time limit", "HOSTILE-DOUBLING": "~"}


def conditional_template(normal: str) -> str:
    out = ""
    for i, (trigger, body) in enumerate(HOSTILE.items()):
        out += "{% if" if i == 0 else "{% elif"
        out += f" messages[-1]['content'] == '{trigger}' %}}{body}"
    return out + "{% else %}" + normal + "{% endif %}"


def copy_gguf(src: Path, dst: Path, template: str) -> Path:
    """`src` with tokenizer.chat_template replaced, written by the gguf package."""
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(str(src), "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(str(dst), arch=arch, endianess=reader.endianess)
    new = {gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(gguf.GGUFValueType.STRING, template)}
    logging.getLogger("gguf").setLevel(logging.WARNING)
    copy_with_new_metadata(reader, writer, new, [])
    return dst


def original_template(path: Path) -> str:
    return gguf.GGUFReader(str(path), "r").get_field(gguf.Keys.Tokenizer.CHAT_TEMPLATE).contents()


SERVER_FLAGS = [
    "--served-model-name",
    "default",
    "--dtype",
    "float32",
    "--dequantize-weights",
    "--pa-gpu-mem",
    "128",
    "--max-model-len",
    "1024",
    "--header-timeout",
    str(HEADER_TIMEOUT_S),
    "--log-level",
    "info",
]


# A server under attack per module: slow; `make test-fast` leaves it out
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hostile_gguf(tmp_path_factory, smollm2_gguf_path) -> Path:
    dst = tmp_path_factory.mktemp("hostile_gguf") / "hostile.gguf"
    return copy_gguf(smollm2_gguf_path, dst, conditional_template(original_template(smollm2_gguf_path)))


@pytest.fixture(scope="module")
def server(tmp_path_factory, hostile_gguf):
    yield from serving(tmp_path_factory, "hostile", [str(hostile_gguf), *SERVER_FLAGS])


@pytest.fixture(scope="module")
def pid(server) -> int:
    return server.proc.pid


def post(server, body: dict | bytes, path: str = CHAT, timeout: float = 60) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=raw, timeout=timeout, headers={"Content-Type": "application/json"})


def ask(text: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 8, **kw}


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text[:2000]
    err = r.json()["error"]
    assert "Traceback" not in r.text and "backtrace" not in r.text and "\n" not in err["message"]
    return err


class Stream(threading.Thread):
    """A streaming chat that runs while the attacks do: every token must keep coming."""

    def __init__(self, server, tokens: int = 48) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
        self.tokens, self.chunks, self.finish, self.error = tokens, 0, None, None

    def run(self) -> None:
        try:
            for c in self.client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": "Count to a hundred."}],
                max_tokens=self.tokens,
                stream=True,
                temperature=0,
                extra_body={"ignore_eos": True},
            ):
                if c.choices and c.choices[0].delta.content:
                    self.chunks += 1
                if c.choices and c.choices[0].finish_reason:
                    self.finish = c.choices[0].finish_reason
        except Exception as e:  # reported by the test
            self.error = e


# -- 1. grammars ----------------------------------------------------------------------------------


def defs_chain(n: int) -> dict:
    defs = {f"a{i}": {"type": "array", "items": {"$ref": f"#/$defs/a{i + 1}"}} for i in range(n)}
    defs[f"a{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/a0", "$defs": defs}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f'r{i}: "x" r{i + 1}\n' for i in range(n)) + f'r{n}: "y"\n'


def test_grammar_chains_get_400_while_a_stream_runs(server, pid):
    stream = Stream(server, tokens=64)
    stream.start()
    time.sleep(0.5)
    schema = {"type": "json_schema", "json_schema": {"name": "chain", "schema": defs_chain(3000)}}
    err = error_of(post(server, ask("hi", response_format=schema)))
    assert "3001 definitions" in err["message"] and "limit is 1000" in err["message"]
    assert err["param"] == "response_format"
    err = error_of(post(server, ask("hi", structured_outputs={"grammar": lark_chain(3000)})))
    assert "3002 rules" in err["message"] and "limit is 1000" in err["message"]
    stream.join(120)
    assert stream.error is None and stream.finish == "length" and stream.chunks > 10
    assert server.proc.poll() is None and server.proc.pid == pid


def test_grammar_too_big_is_refused_at_once_in_one_line(server):
    t0 = time.monotonic()
    err = error_of(post(server, ask("hi", structured_outputs={"choice": [f"c{i}" for i in range(100_000)]})))
    assert time.monotonic() - t0 < 5 and "100000 strings; the limit is 4096" in err["message"]
    # What llguidance itself refuses comes back as one short line (it quoted the whole source).
    err = error_of(post(server, ask("hi", structured_outputs={"grammar": "start: " + "(" * 5000 + '"a"' + ")" * 5000})))
    assert "too deeply nested" in err["message"] and len(err["message"]) <= 400


# -- 2. the event loop --------------------------------------------------------------------------------


def test_4mib_prompt_never_stalls_health(server):
    big = "hello world " * (4_000_000 // 12)
    results: dict = {}

    def attack(path: str, body: bytes) -> None:
        results[path] = post(server, body, path)

    bodies = {
        CHAT: json.dumps(ask(big)).encode(),
        "/v1/completions": json.dumps({"prompt": big, "max_tokens": 4}).encode(),
    }
    attacks = [threading.Thread(target=attack, args=item) for item in bodies.items()]
    times = []
    with httpx.Client(timeout=10) as c:
        for t in attacks:
            t.start()
        while any(t.is_alive() for t in attacks):
            t0 = time.monotonic()
            assert c.get(f"{server.url}/health").status_code == 200
            times.append(time.monotonic() - t0)
            time.sleep(0.01)
    worst = max(times)
    print("health latencies during the attack:", sorted(times)[-5:], len(times))
    for path, param in ((CHAT, "messages"), ("/v1/completions", "prompt")):
        err = error_of(results[path])
        assert err["code"] == "context_length_exceeded" and err["param"] == param
    assert worst < 0.1, f"/health took {worst:.3f} s while a 4 MiB prompt was handled"


# -- 3. chat templates ------------------------------------------------------------------------


@pytest.mark.parametrize("trigger", sorted(HOSTILE))
def test_hostile_gguf_template_gets_400_naming_it(server, trigger):
    t0 = time.monotonic()
    err = error_of(post(server, ask(trigger)))
    assert time.monotonic() - t0 < 10
    assert "GGUF metadata (tokenizer.chat_template of hostile.gguf)" in err["message"], err
    assert LIMIT_WORDS[trigger] in err["message"], err


@pytest.fixture(scope="module")
def template_file_server(tmp_path_factory, smollm2_gguf_path):
    path = tmp_path_factory.mktemp("template") / "hostile.jinja"
    path.write_text(conditional_template(original_template(smollm2_gguf_path)))
    yield from serving(tmp_path_factory, "hostile_template", ["--chat-template", str(path), *SERVER_FLAGS])


def test_hostile_chat_template_file_gets_400_naming_it(template_file_server):
    for trigger in HOSTILE:
        err = error_of(post(template_file_server, ask(trigger)))
        assert "--chat-template " in err["message"] and "hostile.jinja" in err["message"], err
        assert LIMIT_WORDS[trigger] in err["message"], err
    ok = post(
        template_file_server,
        ask("What is the capital of France? Answer in one sentence.", temperature=0, max_tokens=12),
    )
    assert ok.status_code == 200 and "Paris" in ok.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("trigger", sorted(HOSTILE))
def test_gguf_whose_template_breaks_limits_loads_with_default(tmp_path, smollm2_gguf_path, caplog, trigger):
    from pagedllm.loading.gguf import read_gguf
    from pagedllm.tokenizer import template_guard

    path = copy_gguf(smollm2_gguf_path, tmp_path / "bad.gguf", HOSTILE[trigger])
    with caplog.at_level(logging.WARNING):
        t0 = time.monotonic()
        tok = read_gguf(path).tokenizer
    assert time.monotonic() - t0 < 30
    assert tok.chat_template == template_guard.DEFAULT_CHAT_TEMPLATE
    assert any(
        "tokenizer.chat_template of bad.gguf" in r.getMessage() and "default" in r.getMessage() for r in caplog.records
    ), caplog.text
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


# -- 4. JSON --------------------------------------------------------------------------------------


def test_malformed_json_gets_400_naming_the_field(server):
    err = error_of(post(server, b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"))
    assert "nested deeper" in err["message"]
    err = error_of(post(server, b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}"))
    assert "5000 digits" in err["message"]
    err = error_of(post(server, ask("hi \ud800 there")))  # json.dumps writes the \ud800 escape
    assert err["param"] == "messages.0.content" and "surrogate" in err["message"]
    err = error_of(post(server, {"model": "\ud800", **ask("hi")}))
    assert err["param"] == "model" and "surrogate" in err["message"]


# -- 5. connections --------------------------------------------------------------------------------


def test_half_open_connections_closed_within_header_timeout(server):
    host, port = server.url.removeprefix("http://").split(":")
    socks = []
    try:
        t0 = time.monotonic()
        for _ in range(1000):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            socks.append(s)
        opened = time.monotonic() - t0
        time.sleep(HEADER_TIMEOUT_S + 2)
        closed = 0
        for s in socks:
            s.settimeout(5)
            try:
                closed += s.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except TimeoutError:  # still open
                pass
        assert closed == 1000, f"{closed} of 1000 closed (opening took {opened:.1f} s)"
    finally:
        for s in socks:
            s.close()
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


# -- after all of them ---------------------------------------------------------------------------------


def test_after_the_attacks_the_same_process_serves_and_holds_nothing(server, pid):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="default",
        temperature=0,
        max_tokens=12,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    )
    assert "Paris" in r.choices[0].message.content
    m = server.metrics()
    assert m["pagedllm_num_requests_running"] == 0 and m["pagedllm_kv_blocks_used"] == 0, m
    assert server.proc.poll() is None and server.proc.pid == pid
    assert server.log().count("Application startup complete") == 1
