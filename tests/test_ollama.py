"""Ollama's API through the official `ollama` client, against `pagedllm serve` on the default
model; greedy answers must equal the OpenAI routes' for the same request."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

from test_server import serving, serving_qwen  # noqa: E402

GREEDY = {"temperature": 0, "num_predict": 12, "seed": 0}
ASK = [{"role": "user", "content": "Name three colors."}]
# In the key order the ollama client's Tool model sends, so both routes template the same text.
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "required": ["a", "b"],
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_gguf_path):
    yield from serving(
        tmp_path_factory,
        "ollama",
        ["--pa-gpu-mem", "256", "--max-model-len", "1024", "--max-seqs", "8", "--log-level", "info"],
    )


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=300)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


def test_list_show_ps_version(client, server, smollm2_gguf_path):
    names = [m.model for m in client.list().models]
    assert names and names[0]
    assert client.list().models[0].size == smollm2_gguf_path.stat().st_size  # the served file's
    shown = client.show(names[0])
    assert "completion" in shown.capabilities
    assert "insert" not in shown.capabilities  # SmolLM2's vocabulary has no FIM tokens
    assert [m.model for m in client.ps().models] == names
    assert httpx.get(f"{server.url}/api/version").json()["version"]


def test_chat_equals_openai(client, oai):
    r = client.chat(model="default", messages=ASK, options=GREEDY, stream=False)
    ref = oai.chat.completions.create(model="default", messages=ASK, temperature=0, max_tokens=12)
    assert r.message.content == ref.choices[0].message.content
    assert r.done and r.done_reason == ref.choices[0].finish_reason
    assert r.eval_count == ref.usage.completion_tokens
    assert r.prompt_eval_count == ref.usage.prompt_tokens and r.total_duration > 0
    parts = list(client.chat(model="default", messages=ASK, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content
    assert parts[-1].done and not any(p.done for p in parts[:-1]) and parts[-1].eval_duration > 0


def test_chat_format_schema(client):
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string", "maxLength": 10}},
        "required": ["color"],
        "additionalProperties": False,
    }
    r = client.chat(model="default", messages=ASK, format=schema, options={**GREEDY, "num_predict": 40})
    assert set(json.loads(r.message.content)) == {"color"}


def test_generate_equals_openai(client, oai):
    r = client.generate(model="default", prompt="Name three colors.", options=GREEDY, keep_alive="5m")
    ref = oai.chat.completions.create(model="default", messages=ASK, temperature=0, max_tokens=12)
    assert r.response == ref.choices[0].message.content
    raw = client.generate(model="default", prompt="The sky is", raw=True, options=GREEDY)
    ref = oai.completions.create(model="default", prompt="The sky is", temperature=0, max_tokens=12)
    assert raw.response == ref.choices[0].text
    assert (
        "".join(
            p.response
            for p in client.generate(model="default", prompt="The sky is", raw=True, options=GREEDY, stream=True)
        )
        == raw.response
    )


def test_embed_on_generative_model_and_management_refused(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="default", input="hello")
    assert "embedding model" in str(e.value)
    for call in (
        lambda: client.pull("llama3"),
        lambda: client.delete("default"),
        lambda: client.create(model="x", from_="default"),
    ):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert "chosen when pagedllm starts" in str(e.value)


def test_fim_refused_without_tokens(client, server):
    r = httpx.post(f"{server.url}/infill", json={"input_prefix": "def f(", "input_suffix": ")"}, timeout=60)
    assert r.status_code == 400 and "fill-in-the-middle tokens" in r.text
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "def f(", "suffix": ")"}, timeout=60)
    assert r.status_code == 400 and "fill-in-the-middle tokens" in r.text


# -- a tool call needs a model that makes one: the real Qwen2.5-Coder-0.5B (skipped without it) --

# One earlier turn shows the call in the template's own <tool_call> tags (the small model
# otherwise writes bare JSON, which only the bare-JSON reading of issue 66's peer fixes takes).
CALL_ASK = [
    {"role": "user", "content": "What is 1 + 1? Use the add tool."},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1, "b": 1}}}]},
    {"role": "tool", "content": "2", "tool_name": "add"},
    {"role": "assistant", "content": "1 + 1 = 2."},
    {"role": "user", "content": "What is 2 + 3? Use the add tool."},
]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    yield from serving_qwen(tmp_path_factory, "ollama-qwen")


def _openai(messages: list[dict]) -> list[dict]:
    """The same conversation in OpenAI's shapes (arguments as JSON text, tool results by call id)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])},
                }
                for i, c in enumerate(m["tool_calls"])
            ]
        if m["role"] == "tool":
            m["tool_call_id"] = "call_0"
            m.pop("tool_name")
        out.append(m)
    return out


@pytest.mark.slow  # a real model file
def test_chat_tool_call_streamed_and_not(qwen):
    client = ollama.Client(host=qwen.url, timeout=300)
    oai = openai.OpenAI(base_url=f"{qwen.url}/v1", api_key="none", max_retries=0, timeout=300)
    assert {"completion", "tools", "insert"} <= set(client.show("qwen").capabilities)
    opts = {"temperature": 0, "num_predict": 60}
    r = client.chat(model="qwen", messages=CALL_ASK, tools=[ADD], options=opts)
    ref = oai.chat.completions.create(
        model="qwen", messages=_openai(CALL_ASK), tools=[ADD], temperature=0, max_tokens=60
    )
    calls = r.message.tool_calls or []
    assert r.message.content == (ref.choices[0].message.content or "")
    assert all(isinstance(c.function.arguments, dict) for c in calls)
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in ref.choices[0].message.tool_calls or []
    ]
    parts = list(client.chat(model="qwen", messages=CALL_ASK, tools=[ADD], options=opts, stream=True))
    assert parts[-1].done and [
        (c.function.name, dict(c.function.arguments)) for p in parts for c in p.message.tool_calls or []
    ] == [(c.function.name, dict(c.function.arguments)) for c in calls]


def test_tool_call_answer_has_object_arguments():
    """A model's <tool_call> answer (hermes tags, as Qwen's template offers tools) comes back as
    Ollama's tool_calls with `arguments` an object, whole and streamed."""
    from types import SimpleNamespace

    from pagedllm.protocols import ollama as dialect
    from pagedllm.protocols.common import chat as neutral

    template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<tool_call>{% endif %}"
    ctx = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=template))
    plan = neutral.tool_plan(ctx, [ADD], "auto", None)
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    metrics = SimpleNamespace(arrival_time=1.0, first_token_time=1.5, finished_time=2.0, num_prompt_tokens=7)
    out = SimpleNamespace(
        outputs=[SimpleNamespace(text=text, delta_text=text, token_ids=[1, 2, 3], finish_reason="stop")],
        metrics=metrics,
    )
    whole = dialect._answer("m", out, True, plan)
    assert whole["message"]["tool_calls"] == [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
    assert whole["message"]["content"] == "" and whole["done_reason"] == "stop"
    assert whole["total_duration"] == 1_000_000_000 and whole["eval_count"] == 3
    [line] = dialect.NDJSONStreamer("m", True, plan).events(out)
    assert json.loads(line)["message"]["tool_calls"] == whole["message"]["tool_calls"]


def test_codex_oss_probes(client, server):
    """Codex's --oss mode: /api/version compared against the Ollama release it needs, /api/tags,
    then /api/pull of its model, which for the model served is a success with nothing to fetch."""
    version = httpx.get(f"{server.url}/api/version").json()["version"]
    assert tuple(map(int, version.split("."))) >= (0, 13, 4)
    name = client.list().models[0].model
    assert [p.status for p in client.pull(name, stream=True)] == ["pulling manifest", "success"]
    assert client.pull(name).status == "success"
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3:70b")
    assert e.value.status_code == 404 and "pagedllm serve" in e.value.error


def test_num_predict_past_the_context_is_served_to_its_end(client):
    """num_predict is a ceiling (as Ollama reads it): past the context's room, the answer runs
    to the context's end, never a refusal."""
    long = "one two three four five six seven eight nine ten " * 90
    r = client.generate(model="default", prompt=long, options={"num_predict": 100_000, "temperature": 0}, stream=False)
    assert r.done and r.prompt_eval_count > 900 and r.prompt_eval_count + r.eval_count <= 1024
