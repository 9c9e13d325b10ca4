"""The Responses API (issue 23, failure 7 and acceptance 4) through the real `openai` client:
plain, streamed, with a function tool, with a `text.format` JSON schema, and continued with
`previous_response_id`. Every response and stream event is validated strictly against the
client's own types; texts are compared with the chat route's answer to the same messages."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from pydantic import TypeAdapter  # noqa: E402
from test_server import serving  # noqa: E402

TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city", "parameters": WEATHER}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
INSTRUCTIONS = "Answer in one short sentence."
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0.0, "max_output_tokens": 24}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_gguf_path):
    yield from serving(
        tmp_path_factory,
        "responses",
        [
            "--chat-template",
            str(TEMPLATE),
            "--dtype",
            "float32",
            "--pa-gpu-mem",
            "256",
            "--max-model-len",
            "1024",
            "--responses-store-size",
            "3",
            "--log-level",
            "info",
        ],
    )


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
    assert hasattr(c, "responses"), f"openai {openai.__version__} has no Responses API"
    return c


def strict(resp) -> None:
    """The response validates as the client's Response type (not only the client's lenient build)."""
    openai.types.responses.Response.model_validate(resp.model_dump(mode="json", exclude_unset=True, by_alias=True))


@pytest.mark.slow
def test_plain_text_and_instructions_as_the_chat_route(client):
    r = client.responses.create(model="default", input=QUESTION, instructions=INSTRUCTIONS, **GREEDY)
    strict(r)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "default"
    assert r.status in ("completed", "incomplete") and r.instructions == INSTRUCTIONS
    assert [o.type for o in r.output] == ["message"]
    chat = client.chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
        temperature=0.0,
        max_tokens=24,
    )
    assert r.output_text == chat.choices[0].message.content and "Paris" in r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    want = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert r.status == want
    if want == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_message_input_items(client):
    r = client.responses.create(
        model="default",
        input=[
            {"role": "developer", "content": INSTRUCTIONS},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        ],
        **GREEDY,
    )
    strict(r)
    plain = client.responses.create(model="default", input=QUESTION, instructions=INSTRUCTIONS, **GREEDY)
    assert r.output_text == plain.output_text  # the developer message is the system prompt


def _events(stream) -> list:
    adapter = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    events = []
    for ev in stream:
        adapter.validate_python(
            ev.model_dump(mode="json", exclude_unset=True, by_alias=True)
        )  # strictly the client's type
        events.append(ev)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_streamed_text(client):
    plain = client.responses.create(model="default", input=QUESTION, instructions=INSTRUCTIONS, **GREEDY)
    events = _events(
        client.responses.create(model="default", input=QUESTION, instructions=INSTRUCTIONS, stream=True, **GREEDY)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ], kinds
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{plain.status}",
    ], kinds
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds) > 9
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == events[-3].part.text == events[-2].item.content[0].text
    final = events[-1].response
    assert final.output_text == text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


@pytest.mark.slow
def test_function_tool_then_its_output(client):
    r = client.responses.create(
        model="default",
        input="What's the weather in Paris, in celsius?",
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        temperature=0.9,
    )
    strict(r)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed", r.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # The tool's answer goes back with previous_response_id; the model answers in text.
    r2 = client.responses.create(
        model="default",
        previous_response_id=r.id,
        tools=[TOOL],
        max_output_tokens=16,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21, "unit": "C"}'}],
    )
    strict(r2)
    assert r2.previous_response_id == r.id and r2.output[0].type == "message"
    assert r2.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens


def test_streamed_function_call(client):
    events = _events(
        client.responses.create(
            model="default",
            input="Weather in Oslo in F?",
            tools=[TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0.0,
            stream=True,
        )
    )
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert len(added) == 1
    item_id = added[0].item.id
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].item_id == item_id and done[0].arguments == args
    jsonschema.validate(json.loads(args), WEATHER)
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [o for o in final.output if o.type == "function_call"][0].arguments == args


def test_text_format_json_schema(client):
    r = client.responses.create(
        model="default",
        input="Give a European capital and its population as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
        temperature=0.9,
        max_output_tokens=80,
    )
    strict(r)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), CITY)


def test_previous_response_id_carries_the_conversation(server, client):
    r1 = client.responses.create(model="default", input="My name is Ada.", instructions="Be brief.", **GREEDY)
    r2 = client.responses.create(model="default", input="What is my name?", previous_response_id=r1.id, **GREEDY)
    strict(r2)
    # The second prompt is the whole conversation (the first's instructions are not carried over).
    messages = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    tok = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30).json()
    assert r2.usage.input_tokens == tok["count"]
    assert client.responses.retrieve(r2.id).output_text == r2.output_text


def test_store_is_bounded(client):
    ids = [client.responses.create(model="default", input=f"Say {i}.", max_output_tokens=2).id for i in range(4)]
    with pytest.raises(openai.NotFoundError) as e:  # the store keeps the latest 3
        client.responses.create(model="default", input="Hi", previous_response_id=ids[0], max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id" and ids[0] in e.value.body["message"]
    client.responses.create(model="default", input="Hi", previous_response_id=ids[-1], max_output_tokens=2)
    unstored = client.responses.create(model="default", input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"input": QUESTION, "tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
            "input.0.content.0",
        ),
        ({"input": []}, "input"),
        (
            {"input": QUESTION, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            "text.format",
        ),
        ({"input": QUESTION, "max_output_tokens": 5000}, "max_output_tokens"),
        ({"input": QUESTION, "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": QUESTION, "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ],
)
def test_bad_requests(client, kw, param):
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
        client.responses.create(model="default", **kw)
    assert e.value.body["param"] == param, e.value.body


# -- Codex CLI's tools (issue 78): namespace, custom and hosted tools, tool outputs as parts ------

NAMESPACE = {
    "type": "namespace",
    "name": "weather_v1",
    "description": "Weather tools.",
    "tools": [{**TOOL, "strict": False}],
}
CUSTOM = {
    "type": "custom",
    "name": "set_code",
    "description": "Set a code of three letters and two digits",
    "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]{3}-[0-9]{2}"},
}


def test_namespace_call_comes_back_with_its_namespace(client):
    """A namespaced function is offered under its own name; its call names the namespace, and
    sent back as history (with its output as content parts, Codex's other shape) it is
    understood; hosted tools (web_search) are left out, not refused."""
    r = client.responses.create(
        model="default",
        input="What's the weather in Paris, in celsius?",
        tools=[NAMESPACE, {"type": "web_search", "external_web_access": False}],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0.0,
        parallel_tool_calls=False,
        include=["reasoning.encrypted_content"],
        reasoning={"summary": "auto"},
        store=False,
        prompt_cache_key="k",
    )
    strict(r)
    call = r.output[0].model_dump()
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["namespace"] == "weather_v1"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    r2 = client.responses.create(
        model="default",
        tools=[NAMESPACE],
        max_output_tokens=8,
        input=[
            {"role": "user", "content": "What's the weather in Paris, in celsius?"},
            {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},
            {k: call[k] for k in ("type", "name", "namespace", "arguments", "call_id")},
            {
                "type": "function_call_output",
                "call_id": call["call_id"],
                "output": [{"type": "input_text", "text": "21 C"}, {"type": "input_image", "image_url": "data:,"}],
            },
        ],
    )
    strict(r2)
    assert r2.output[0].type == "message"


def test_custom_tool_input_follows_its_regex(client):
    """A custom tool takes free text: its call is a custom_tool_call whose input matches the
    tool's regex grammar (llguidance enforces it under a forced choice), whole or streamed."""
    r = client.responses.create(
        model="default",
        input="Set the code to abc-12.",
        tools=[CUSTOM],
        tool_choice={"type": "custom", "name": "set_code"},
        temperature=0.9,
    )
    strict(r)
    item = r.output[0]
    assert item.type == "custom_tool_call" and item.name == "set_code"
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", item.input), item.input
    events = _events(
        client.responses.create(
            model="default",
            input="Set the code.",
            tools=[CUSTOM],
            tool_choice={"type": "custom", "name": "set_code"},
            temperature=0.9,
            stream=True,
        )
    )
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[0].item.type == "custom_tool_call" and re.fullmatch(r"[a-z]{3}-[0-9]{2}", done[0].item.input)
    assert events[-1].response.output[0].input == done[0].item.input
    # The call and its output, sent back as Codex sends them, are the next turn's history.
    r2 = client.responses.create(
        model="default",
        tools=[CUSTOM],
        max_output_tokens=8,
        input=[
            {"role": "user", "content": "Set the code to abc-12."},
            {"type": "custom_tool_call", "call_id": item.call_id, "name": "set_code", "input": item.input},
            {"type": "custom_tool_call_output", "call_id": item.call_id, "output": "done"},
        ],
    )
    strict(r2)
