"""Coding agents' own requests, replayed: the first request Claude Code and Codex CLI sent to a
local server (recorded from the real tools, installed from npm, by pointing them at a recording
server; tests/data/agents/, long texts shortened), sent again as they came, headers included,
to `pagedllm serve` on the default model. Each is answered 200 with the stream its client
parses, every event validated against the official SDK's types; sent a second time, the prompt
comes from the prefix cache and the usage says so where the client reads it (Claude Code:
`cache_read_input_tokens` in message_delta; Codex: `usage.input_tokens_details.cached_tokens`
in response.completed), although Claude Code's attribution line changed between the two.

The agents themselves run in `make agents` (tests/agents/), minutes a turn on two cores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

from pydantic import TypeAdapter  # noqa: E402
from test_server import serving  # noqa: E402

RECORDED = Path(__file__).parent / "data" / "agents"
CLAUDE = RECORDED / "claude-code-2.1.337-first.json"
CODEX = RECORDED / "codex-0.171.0-first.json"


@pytest.fixture(scope="module")
def started(tmp_path_factory, smollm2_gguf_path):
    # Served as "qwen", the name the agents were started with; a context several times the
    # shortened first prompts, so each answer has room left and Claude Code's max_tokens (32,000)
    # is past it.
    yield from serving(
        tmp_path_factory,
        "agent-replay",
        [
            "--served-model-name",
            "qwen",
            "--max-model-len",
            "4096",
            "--pa-gpu-mem",
            "384",
            "--max-seqs",
            "4",
            "--log-level",
            "info",
        ],
    )


@pytest.fixture
def server(started):
    return started.get()


def sse(response: httpx.Response) -> list[tuple[str | None, dict]]:
    """(event name, data) of each server-sent event."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            events.append((name, json.loads(line[5:])))
            name = None
    return events


def replay(server, recorded: dict, body: dict | None = None) -> list[tuple[str | None, dict]]:
    with httpx.stream(
        recorded["method"],
        server.url + recorded["path"],
        headers=recorded["headers"],
        json=body or recorded["body"],
        timeout=600,
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse(r)


def test_claude_code_first_request(server):
    recorded = json.loads(CLAUDE.read_text())
    body = recorded["body"]
    assert body["max_tokens"] == 32000 and body["stream"] and body["thinking"]["type"] == "adaptive"
    assert any(m["role"] == "system" for m in body["messages"])  # a system message among messages
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    usages = []
    for attempt in range(2):
        if attempt:  # Claude Code's attribution line changes from request to request
            body["system"][0]["text"] = body["system"][0]["text"].replace("cc_version=", "cc_version=9.")
        events = replay(server, recorded, body)
        for name, data in events:
            assert name == data["type"]
            if name != "ping":  # (the SDK's event union leaves the keep-alive out)
                adapter.validate_python(data)
        kinds = [name for name, _ in events]
        assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
        delta = events[-2][1]
        assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
        usages.append(delta["usage"])
    n_prompt = events[0][1]["message"]["usage"]["input_tokens"]
    assert n_prompt > 2000  # the shortened prompt is still a real agent's: tools, system, reminders
    assert usages[0]["cache_read_input_tokens"] < usages[1]["cache_read_input_tokens"]
    assert usages[1]["cache_read_input_tokens"] >= n_prompt - 2 * 32  # all but its last blocks
    assert usages[1]["input_tokens"] + usages[1]["cache_read_input_tokens"] == n_prompt


def test_claude_code_model_list(server):
    """Claude Code (and Anthropic's SDK) list models with `anthropic-version` set: Anthropic's
    shape then; OpenAI's without it."""
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    page = client.models.list(limit=1000)
    assert [m.id for m in page.data] == ["qwen"] and page.data[0].type == "model"
    assert client.models.retrieve("qwen").id == "qwen"
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in oai.models.list().data] == ["qwen"]


def test_codex_first_request(server):
    recorded = json.loads(CODEX.read_text())
    body = recorded["body"]
    kinds = {t["type"] for t in body["tools"]}
    assert {"function", "namespace", "web_search"} <= kinds
    assert body["include"] == ["reasoning.encrypted_content"] and body["store"] is False
    adapter = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    cached = []
    for _ in range(2):
        events = replay(server, recorded)
        for name, data in events:
            assert name == data["type"]
            adapter.validate_python(data)
        names = [name for name, _ in events]
        assert names[:2] == ["response.created", "response.in_progress"]
        assert names[-1] in ("response.completed", "response.incomplete")
        final = events[-1][1]["response"]
        assert final["output"] and final["usage"]["input_tokens"] > 2000
        for item in final["output"]:  # every call names a tool Codex offered, as Codex names it
            if item["type"] == "function_call":
                offered = {t["name"] for t in body["tools"] if t["type"] == "function"} | {
                    f["name"] for t in body["tools"] if t["type"] == "namespace" for f in t["tools"]
                }
                assert item["name"] in offered
        cached.append(final["usage"]["input_tokens_details"]["cached_tokens"])
    assert cached[1] > cached[0] and cached[1] >= final["usage"]["input_tokens"] - 2 * 32


def test_openai_output_budget_past_the_room_is_served(server):
    """qwen-code sends max_tokens = the model's whole context, opencode (offline) 32,000: a limit
    the context could hold by itself is served up to the room the prompt leaves ("length");
    one larger than the whole context keeps OpenAI's context_length_exceeded."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "one two three four five six seven eight nine ten " * 300}]
    r = client.chat.completions.create(
        model="qwen", messages=messages, max_tokens=4096, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens > 3000
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 4096
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="qwen", messages=messages, max_tokens=4097)
    assert e.value.body["code"] == "context_length_exceeded"
