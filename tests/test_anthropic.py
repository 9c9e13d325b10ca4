"""Anthropic Messages (/v1/messages, /v1/messages/count_tokens) through the official `anthropic`
SDK against `pagedllm serve` on the default small model: answers equal OpenAI chat's for the
same conversation, the stream's events equal the SDK's own accumulation, forced tool use under
the grammar, tool results, stop sequences, count_tokens, auth and Anthropic's error shape."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from test_server import API_KEY, serving  # noqa: E402

ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -100, "maximum": 100},
        "b": {"type": "integer", "minimum": -100, "maximum": 100},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "add", "description": "Add two integers", "input_schema": ADD},
    {"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER},
]
ASK = [{"role": "user", "content": "What is 2 + 3? Answer briefly."}]
# The SDK (2.x) has no sampling arguments any more (newer Claude models fix them); the wire
# fields temperature/top_p/top_k are still Anthropic's, sent here as extra body fields.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def started(tmp_path_factory, smollm2_gguf_path):
    yield from serving(
        tmp_path_factory,
        "anthropic",
        [
            "--api-key",
            API_KEY,
            "--allowed-origins",
            "https://app.example",
            "--pa-gpu-mem",
            "256",
            "--max-model-len",
            "1024",
            "--max-seqs",
            "8",
            "--log-level",
            "info",
        ],
    )


@pytest.fixture
def server(started):
    return started.get()


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _blocks(msg) -> list[tuple]:
    return [
        (
            b.type,
            getattr(b, "text", None),
            getattr(b, "thinking", None),
            getattr(b, "name", None),
            getattr(b, "input", None),
        )
        for b in msg.content
    ]


def _text(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


@pytest.mark.slow
def test_message_equals_openai_chat_greedy(client, oai):
    msg = client.messages.create(model="default", max_tokens=24, **GREEDY, messages=ASK, system="You are terse.")
    chat = oai.chat.completions.create(
        model="default", max_tokens=24, temperature=0, messages=[{"role": "system", "content": "You are terse."}, *ASK]
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert _text(msg) == chat.choices[0].message.content
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    assert msg.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    # system as blocks is the same prompt as system as a string
    blocks = client.messages.create(
        model="default", max_tokens=24, **GREEDY, messages=ASK, system=[{"type": "text", "text": "You are terse."}]
    )
    assert _text(blocks) == _text(msg)


def test_stream_events_match_final_message(client):
    kinds = []
    with client.messages.stream(model="default", max_tokens=20, **GREEDY, messages=ASK) as stream:
        for ev in stream:
            kinds.append(ev.type)
        final = stream.get_final_message()
    whole = client.messages.create(model="default", max_tokens=20, **GREEDY, messages=ASK)
    assert _blocks(final) == _blocks(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the SDK yields its own "text" events beside the raw ones: look at the raw sequence
    raw = [
        k
        for k in kinds
        if k
        in (
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        )
    ]
    assert raw[0] == "message_start" and raw[1] == "content_block_start"
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) == {"content_block_delta"}


def test_raw_stream_has_ping_and_indexes(server):
    body = {"model": "default", "max_tokens": 8, "temperature": 0, "stream": True, "messages": ASK}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    events = [e for e in text.split("\n\n") if e.strip()]
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    datas = [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in events]
    assert names[:2] == ["message_start", "ping"]
    assert all(d["type"] == n for n, d in zip(names, datas))
    assert datas[0]["message"]["usage"]["input_tokens"] > 0
    assert [d["index"] for d in datas if "index" in d] == [0] * sum("index" in d for d in datas)


def test_stop_sequence(client):
    whole = _text(client.messages.create(model="default", max_tokens=24, **GREEDY, messages=ASK))
    words = whole.split()
    if len(words) < 3:
        pytest.skip(f"the greedy answer {whole!r} is too short to cut")
    stop = words[2]
    msg = client.messages.create(model="default", max_tokens=24, **GREEDY, messages=ASK, stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert _text(msg) == whole[: whole.index(stop)]


@pytest.mark.slow
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "add"}])
def test_forced_tool_use_round_trip(client, choice):
    ask = [{"role": "user", "content": "Add 2 and 3 with the tool."}]
    msg = client.messages.create(
        model="default", max_tokens=64, **GREEDY, messages=ask, tools=TOOLS, tool_choice=choice
    )
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and uses and not _text(msg)
    if choice["type"] == "tool":
        assert {u.name for u in uses} == {"add"}
    for u in uses:
        jsonschema.validate(u.input, {t["name"]: t["input_schema"] for t in TOOLS}[u.name])
    # streamed: the same blocks through the SDK's accumulation
    with client.messages.stream(
        model="default", max_tokens=64, **GREEDY, messages=ask, tools=TOOLS, tool_choice=choice
    ) as stream:
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(msg)
    # the results (one an error, with text beside it) go back, and the model answers in text
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "5"} for u in uses]
    results[0] = {**results[0], "is_error": True, "content": [{"type": "text", "text": "overflow"}]}
    answer = client.messages.create(
        model="default",
        max_tokens=16,
        **GREEDY,
        tools=TOOLS,
        messages=[
            *ask,
            {"role": "assistant", "content": msg.content},
            {"role": "user", "content": [*results, {"type": "text", "text": "So what is it?"}]},
        ],
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    count = client.messages.count_tokens(
        model="default",
        tools=TOOLS,
        messages=[
            *ask,
            {"role": "assistant", "content": msg.content},
            {"role": "user", "content": [*results, {"type": "text", "text": "So what is it?"}]},
        ],
    )
    assert count.input_tokens == answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)


def test_count_tokens_equals_served_prompt(client):
    count = client.messages.count_tokens(model="default", messages=ASK, system="Be brief.")
    msg = client.messages.create(model="default", max_tokens=1, messages=ASK, system="Be brief.")
    assert count.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)


def test_claude_code_attribution_line_keeps_the_prefix(client):
    def system(n: int) -> list[dict]:
        return [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.0.{n}; cch={n:05d};"},
            {"type": "text", "text": "You are a coding agent. " * 20},
        ]

    plain = client.messages.count_tokens(model="default", messages=ASK, system=system(1)[1:]).input_tokens
    assert client.messages.count_tokens(model="default", messages=ASK, system=system(1)).input_tokens == plain
    client.messages.create(model="default", max_tokens=1, messages=ASK, system=system(1))
    second = client.messages.create(model="default", max_tokens=1, messages=ASK, system=system(2))
    assert second.usage.cache_read_input_tokens > 0


def test_auth_and_errors(server):
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=API_KEY, max_retries=0, timeout=300)
    assert bearer.messages.create(model="default", max_tokens=2, messages=ASK).content is not None
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model="default", max_tokens=2, messages=ASK)
    assert e.value.status_code == 401 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(
        f"{server.url}/v1/messages",
        json={"model": "default", "messages": ASK},
        headers={"x-api-key": API_KEY},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(
        f"{server.url}/v1/messages",
        json={"model": "nope", "max_tokens": 2, "messages": ASK},
        headers={"x-api-key": API_KEY},
        timeout=60,
    )
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_cors_preflight_with_key(server):
    r = httpx.options(
        f"{server.url}/v1/messages",
        timeout=30,
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "x-api-key,content-type",
        },
    )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"


def test_openapi_and_help_describe_the_routes(server):
    paths = httpx.get(f"{server.url}/openapi.json", headers={"x-api-key": API_KEY}, timeout=30).json()["paths"]
    assert "/v1/messages" in paths and "/v1/messages/count_tokens" in paths
    assert paths["/v1/messages"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "MessagesRequest"
    )


# -- what Claude Code sends (issue 78) ------------------------------------------------------------


def test_max_tokens_past_the_context_is_served_to_its_end(client):
    """Claude Code asks for max_tokens 32,000-64,000 whatever the model: served up to the room the
    context leaves (this server's is 1,024 tokens), not refused; a prompt with no room left is."""
    long = [{"role": "user", "content": "one two three four five six seven eight nine ten " * 90}]
    msg = client.messages.create(model="default", max_tokens=64000, messages=long, **GREEDY)
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert 900 < msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens + msg.usage.output_tokens <= 1024
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model="default", max_tokens=8, messages=[{"role": "user", "content": long[0]["content"] * 2}]
        )
    assert "prompt is too long" in e.value.body["error"]["message"]


@pytest.mark.parametrize("field, value", [("temperature", 1.5), ("temperature", -0.1), ("top_p", 2)])
def test_sampling_out_of_anthropic_ranges(client, field, value):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="default", max_tokens=4, messages=ASK, extra_body={field: value})
    assert e.value.body["error"]["type"] == "invalid_request_error" and field in e.value.body["error"]["message"]


def test_claude_code_request_fields(client):
    """The fields and blocks of Claude Code's requests: system messages among the messages,
    metadata, context_management, output_config, thinking (adaptive, display omitted), a
    deferred tool and a hosted one left out of the prompt, cache_control, a thinking block sent
    back with its signature, a tool_result holding text and an image, the anthropic-beta header."""
    plain = client.messages.count_tokens(model="default", messages=ASK, tools=TOOLS[:1]).input_tokens
    deferred = {
        "name": "later",
        "description": "A tool found by search",
        "defer_loading": True,
        "input_schema": WEATHER,
    }
    hosted = {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}
    assert (
        client.messages.count_tokens(model="default", messages=ASK, tools=[*TOOLS[:1], deferred, hosted]).input_tokens
        == plain
    )
    thought = "The user wants a sum."
    signed = client.messages.create(
        model="default",
        max_tokens=8,
        tools=[*TOOLS[:1], deferred, hosted],
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "", "signature": _signature(thought)},
                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [
                            {"type": "text", "text": "5"},
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
                            {"type": "tool_reference", "tool_name": "later"},
                        ],
                    },
                    {"type": "text", "text": "Thanks.", "cache_control": {"type": "ephemeral"}},
                ],
            },
            {"role": "system", "content": "Answer in English."},
        ],
        extra_body={
            "metadata": {"user_id": "u"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
            "output_config": {"effort": "high"},
            "thinking": {"type": "adaptive", "display": "omitted"},
        },
        extra_headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"},
    )
    assert signed.content is not None and signed.stop_reason in ("end_turn", "max_tokens", "tool_use")


def _signature(thought: str) -> str:
    from pagedllm.protocols.anthropic.answer import signature

    return signature(thought)


def test_thinking_signature_carries_its_text():
    from pagedllm.protocols.anthropic.answer import signature, thought_of
    from pagedllm.protocols.anthropic.messages import MessagesRequest, neutral_messages

    assert thought_of(signature("Let me think: é∑")) == "Let me think: é∑"
    assert thought_of("EqQBCkgIARABGAIiQL...") == ""  # another server's signature carries nothing here
    req = MessagesRequest(
        max_tokens=4,
        messages=[
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "", "signature": signature("hmm")},
                    {"type": "text", "text": "Hello"},
                ],
            },
        ],
    )
    assert neutral_messages(req, None, False)[1]["reasoning_content"] == "hmm"


def test_structured_output_by_output_config(client):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    msg = client.messages.create(
        model="default",
        max_tokens=32,
        messages=ASK,
        extra_body={"temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    jsonschema.validate(json.loads(_text(msg)), schema)
