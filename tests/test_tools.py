"""Tool calling in /v1/chat/completions (issue 12), with the real `openai` client.

The server renders tools through a Hermes-style template in Qwen2.5's shape (tests/data);
forced calls (`required`, named) are constrained by the functions' schemas and must validate
every time; `auto` output is parsed into tool_calls, streamed as OpenAI streams them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from pagedllm.structured import tool_parser, tools as tool_api  # noqa: E402
from test_server import serving  # noqa: E402

TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -100, "maximum": 100},
        "b": {"type": "integer", "minimum": -100, "maximum": 100},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather for a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
]
PARAMS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module")
def started_server(tmp_path_factory, smollm2_gguf_path):
    yield from serving(
        tmp_path_factory,
        "tools",
        [
            "--chat-template",
            str(TEMPLATE),
            "--dtype",
            "float32",
            "--pa-gpu-mem",
            "256",
            "--max-model-len",
            "1024",
            "--log-level",
            "info",
        ],
    )


@pytest.fixture
def server(started_server):
    return started_server.get()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


def _streamed_calls(stream) -> tuple[str, list[dict], str | None]:
    text, calls, reason = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        text += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.id or c["id"]
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return text, [calls[i] for i in sorted(calls)], reason


@pytest.mark.slow
def test_forced_calls_validate_every_time(client):
    """20 seeded samples, all but the first sent at once: the server decodes them in one batch,
    each row under its own grammar."""
    import concurrent.futures as cf

    msgs = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]

    def sample(i: int) -> None:
        named = i % 2 == 1
        choice = {"type": "function", "function": {"name": "add"}} if named else "required"
        kw = dict(
            model="default", messages=msgs, tools=TOOLS, tool_choice=choice, temperature=0.9, seed=i, max_tokens=200
        )
        if i % 4 < 2:
            ch = client.chat.completions.create(**kw).choices[0]
            calls = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in ch.message.tool_calls
            ]
            reason = ch.finish_reason
        else:
            _, calls, reason = _streamed_calls(client.chat.completions.create(stream=True, **kw))
        assert calls and reason == "tool_calls", (i, calls, reason)
        for c in calls:
            assert c["id"].startswith("call_")
            assert c["name"] == "add" if named else c["name"] in PARAMS
            jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])

    sample(0)  # alone: the first grammar builds the tokenizer's trie, within the compile limit
    with cf.ThreadPoolExecutor(19) as pool:
        list(pool.map(sample, range(1, 20)))  # re-raises the first failure


def _history() -> list[dict]:
    msgs = [{"role": "system", "content": "You answer every weather question by calling get_weather first."}]
    for i, city in enumerate(["Paris", "Berlin"]):
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "C"})},
        }
        msgs += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": "18 C, sunny"},
            {"role": "assistant", "content": f"It is 18 C and sunny in {city}."},
        ]
    return msgs + [{"role": "user", "content": "What is the weather in Rome?"}]


@pytest.mark.slow
def test_auto_round_trip_call_tool_message_answer(client):
    msgs = _history()
    kw = dict(model="default", messages=msgs, tools=TOOLS, tool_choice="auto", temperature=0.9, max_tokens=80)
    # A 135M model calls the tool on some samples only: take the first seed that does.
    for seed in range(12):
        ch = client.chat.completions.create(seed=seed, **kw).choices[0]
        if ch.message.tool_calls:
            break
    else:
        pytest.fail("no sample called the tool")
    assert ch.finish_reason == "tool_calls"
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
    # the same seeded sample, streamed: the call arrives as tool_calls deltas
    text, calls, reason = _streamed_calls(client.chat.completions.create(seed=seed, stream=True, **kw))
    assert reason == "tool_calls" and [c["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)
    # the tool's answer goes back; the model then answers in text
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "24 C, clear sky"},
    ]
    for seed in range(12):
        final = client.chat.completions.create(
            model="default", messages=msgs, tools=TOOLS, temperature=0.9, seed=seed, max_tokens=60
        ).choices[0]
        if not final.message.tool_calls:
            break
    assert final.message.content and final.finish_reason in ("stop", "length")
    none = client.chat.completions.create(
        model="default", messages=msgs, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=30
    ).choices[0]
    assert none.message.tool_calls is None and none.finish_reason in ("stop", "length")


BAD = {
    "unknown_tool_name": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    "required_without_tools": {"tool_choice": "required"},
    "bad_choice_string": {"tools": TOOLS, "tool_choice": "always"},
    "bad_function_name": {"tools": [{"type": "function", "function": {"name": "has space"}}]},
    "bad_parameters_schema": {
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {
                        "type": "object",
                        "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 1}},
                        "required": ["n"],
                    },
                },
            }
        ],
        "tool_choice": "required",
    },
    "tool_message_without_id": {
        "tools": TOOLS,
        "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}],
    },
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_tool_requests_get_400(server, client, name):
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **BAD[name]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"]
    assert client.chat.completions.create(
        model="default", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    ).choices


# -- the parsers, on fixed text ---------------------------------------------------------------


def test_parse_formats():
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    content, calls = tool_parser.parse(text, "hermes")
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]
    assert tool_parser.parse("no call here", "hermes") == ("no call here", [])
    _, calls = tool_parser.parse('{"name": "g", "parameters": {"y": "z"}}', "llama3")
    assert calls[0].name == "g" and json.loads(calls[0].arguments) == {"y": "z"}
    _, calls = tool_parser.parse(
        '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]', "mistral"
    )
    assert [c.name for c in calls] == ["a", "b"]
    assert tool_parser.parse("{not json", "llama3") == ("{not json", [])


def test_stream_parser_holds_back_a_partial_tag():
    p = tool_parser.StreamParser("hermes")
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call> done'
    sent, calls = "", []
    for i in range(0, len(text), 3):  # three characters at a time: tags split across deltas
        s, c = p.feed(text[i : i + 3])
        assert "<" not in s  # never a piece of the tag
        sent, calls = sent + s, calls + c
    s, c = p.finish()
    sent, calls = sent + s, calls + c
    calls = tool_parser.merge_deltas(calls)  # deltas: the call's head, then its arguments in pieces
    assert sent == "Sure. done" and [c.name for c in calls] == ["f"]
    assert json.loads(calls[0].arguments) == {"x": 2}


# -- bare and fenced JSON calls under tool_choice=auto (issue 66.5) --------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "add", "arguments": {"a": 2, "b": 3}}',
        '```json\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n```',
        '[{"name": "add", "parameters": {"a": 2, "b": 3}}]',
    ],
)
def test_bare_json_call_naming_a_tool_is_a_call(text):
    from pagedllm.protocols.common.chat import parse_answer

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    plan = tool_api.plan(tools, "auto", None, None, {})
    content, calls = parse_answer(text, plan)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 3})]
    # a JSON answer that names no tool of the request stays content
    for other in ('{"name": "sub", "arguments": {"a": 2}}', '{"result": 5}'):
        assert parse_answer(other, plan) == (other, [])
    # and nothing changes where no tool may be called
    assert parse_answer(text, tool_api.plan(tools, "none", None, None, {})) == (text, [])


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "add", "arguments": {"a": 2, "b": 3}}',
        '```json\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n```',
        '[{"name": "add", "parameters": {"a": 2, "b": 3}}]',
        '{"name": "sub", "arguments": {"a": 2}}',
        '{"result": 5}',
        "```python\nprint(1)\n```",
        'Sure: {"name": "add", "arguments": {}}',
        "Plain words.",
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    ],
)
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_streamed_answer_splits_as_the_whole_one(text, size):
    """Under tool_choice=auto a streamed answer gives the same content and calls as the whole
    answer, bare and fenced JSON calls included; an answer that cannot be such JSON is not held."""
    from pagedllm.protocols.common.chat import answer_stream_parser, parse_answer

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    plan = tool_api.plan(tools, "auto", None, None, {})
    content, calls = parse_answer(text, plan)
    p = answer_stream_parser(plan)
    sent, deltas = "", []
    for i in range(0, len(text), size):
        s, d = p.feed(text[i : i + size])
        if i == 0 and size < len(text) and not text.startswith(("{", "[", "`")):
            assert s or text.startswith("<"), "an answer that cannot be bare JSON streams at once"
        sent, deltas = sent + s, deltas + d
    s, d = p.finish()
    sent, deltas = sent + s, deltas + d
    streamed = tool_parser.merge_deltas(deltas)
    assert (sent or None) == content and p.calls == len(calls)
    assert [(c.name, json.loads(c.arguments)) for c in streamed] == [(c.name, json.loads(c.arguments)) for c in calls]
