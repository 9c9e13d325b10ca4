"""What real OpenAI clients rely on (issue 23), through the real `openai` client.

Forced tool calls in every format the server reads off templates, completions logprobs, logit_bias,
aborts of gone clients, and the wire details of streamed chunks. The server runs the default model
with its own chat template (which has no place for tools, so they go in the system prompt, answered
in the hermes format); tests/test_tools.py covers a Qwen2.5-shaped template.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from pagedllm.structured import tool_parser, tools as tool_api  # noqa: E402
from test_server import serving  # noqa: E402

# A Pydantic-style schema: nested models under $defs, referenced with $ref; enums, arrays.
WEATHER = {
    "$defs": {
        "Unit": {"enum": ["C", "F"], "type": "string"},
        "Options": {
            "type": "object",
            "properties": {"unit": {"$ref": "#/$defs/Unit"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "options": {"$ref": "#/$defs/Options"},
        "fields": {"type": "array", "items": {"enum": ["temp", "wind", "rain"]}, "maxItems": 3},
    },
    "required": ["city", "options"],
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
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_gguf_path):
    # Without the server's pacing of prompts beside decodes (engine/pacing.py): the client-gone
    # test below needs the engine busy with one whole-budget prefill step while clients leave.
    yield from serving(
        tmp_path_factory,
        "compat",
        [
            "--pa-gpu-mem",
            "256",
            "--max-model-len",
            "1024",
            "--max-seqs",
            "16",
            "--log-level",
            "info",
            "--decode-latency-factor",
            "0",
        ],
    )


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


# -- 0. the Runner and the server answer alike ------------------------------------------------------

# What differs between two answers to the same request: ids, creation times, timing figures, the
# cached prompt tokens (each engine's prefix cache holds its own history) and the model's name (the
# server serves "default", the Runner names the file it loaded).
_PER_CALL = {
    "id",
    "created",
    "model",
    "avg_tok_per_sec",
    "avg_prompt_tok_per_sec",
    "avg_compl_tok_per_sec",
    "total_time_sec",
    "total_prompt_time_sec",
    "total_completion_time_sec",
    "prompt_tokens_details",
}


def _same_answer(a, b, where: str = "") -> None:
    """Equal JSON, but for the per-call fields; a tool call's id only has to look like one, and
    logprobs agree to 1e-3 (two processes' float sums)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = set(a) - _PER_CALL
        assert keys == set(b) - _PER_CALL, (where, sorted(keys ^ (set(b) - _PER_CALL)))
        for k in keys:
            _same_answer(a[k], b[k], f"{where}.{k}")
        if "id" in a and str(a["id"]).startswith("call_"):
            assert str(b["id"]).startswith("call_"), (where, b["id"])
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _same_answer(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, abs=1e-3), (where, a, b)
    else:
        assert a == b, (where, a, b)


@pytest.mark.slow
def test_runner_and_server_give_the_same_answers(server, runner):
    """The same requests through the Runner and the HTTP server: the same forced tool calls (parsed,
    not `<tool_call>` text), logprobs, finish reasons, usage and stream chunks. One top logprob: with
    two, a near-tie for second place may fall either way between two processes' float sums. First in
    the module, on fresh engines: after the module's other requests the server's greedy answer to
    the completion prompt was seen to differ from a fresh Runner's (history-dependent numerics,
    reported separately)."""
    weather = [{"role": "user", "content": "What is the weather in Lyon in C, for 2 days?"}]
    chat = {
        "model": "default",
        "messages": weather,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 120,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "logprobs": True,
        "top_logprobs": 1,
    }
    text = {
        "model": "default",
        "prompt": ["The capital of Spain is", "One, two,"],
        "max_tokens": 5,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
        "n": 2,
    }
    answers = {}
    for path, body, send in (
        ("chat/completions", chat, runner.send_chat_completion_request),
        ("completions", text, runner.send_completion_request),
    ):
        served = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=300)
        assert served.status_code == 200, served.text
        answers[path] = served.json()
        ours = send(dict(body)).model_dump(mode="json")
        _same_answer(answers[path], ours, path)
        assert answers[path]["model"] == "default" and ours["model"] == runner.llm.model_name
        stream = {**body, "stream_options": {"include_usage": True}}
        ours = [c.model_dump(mode="json") for c in send({**stream, "stream": True})]
        _same_answer(_raw_chunks(server, path, stream), ours, path + " stream")
    choice = answers["chat/completions"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert len(choice["logprobs"]["content"]) == answers["chat/completions"]["usage"]["completion_tokens"]
    assert answers["completions"]["choices"][0]["logprobs"]["token_logprobs"][0] is None  # the echoed prompt's


def _streamed(stream) -> tuple[str | None, list[dict], str | None, list]:
    """(content, calls, finish_reason, the tool-call deltas) of a streamed chat answer."""
    text, calls, reason, deltas = None, {}, None, []
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        if d.content:
            text = (text or "") + d.content
        for tc in d.tool_calls or []:
            deltas.append(tc)
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.id or c["id"]
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return text, [calls[i] for i in sorted(calls)], reason, deltas


def _answer(client, stream: bool, **kw) -> tuple[str | None, list[dict], str | None]:
    if stream:
        text, calls, reason, _ = _streamed(client.chat.completions.create(stream=True, **kw))
        return text, calls, reason
    ch = client.chat.completions.create(**kw).choices[0]
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in ch.message.tool_calls or []
    ]
    return ch.message.content, calls, ch.finish_reason


# -- 1. forced tool calls -----------------------------------------------------------------------


@pytest.mark.slow
def test_forced_calls_20_samples_at_temperature_0_9(client):
    """required and named, streamed and not, parallel on and off: every answer is calls only,
    ends with finish_reason "tool_calls", and its arguments validate against the tool's schema
    ($defs/$ref, enum, nested object, array). After the first, the requests are sent at once:
    the server decodes them in one batch, each row under its own grammar."""
    import concurrent.futures as cf

    def sample(i: int) -> None:
        named = i % 2 == 1
        parallel = i % 3 != 0
        choice = {"type": "function", "function": {"name": "get_weather"}} if named else "required"
        kw = dict(
            model="default",
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            temperature=0.9,
            seed=100 + i,
            max_tokens=400,
            parallel_tool_calls=parallel,
        )
        content, calls, reason = _answer(client, stream=i % 4 >= 2, **kw)
        assert reason == "tool_calls" and not content and calls, (i, content, calls, reason)
        if named or not parallel:
            assert len(calls) == 1, (i, calls)
        for c in calls:
            assert c["id"].startswith("call_")
            assert c["name"] == "get_weather" if named else c["name"] in PARAMS
            jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])

    sample(0)  # alone: the first grammar builds the tokenizer's trie, within the compile limit
    with cf.ThreadPoolExecutor(19) as pool:
        list(pool.map(sample, range(1, 20)))  # re-raises the first failure


def test_forced_call_arguments_stream_as_deltas(client):
    """As OpenAI streams a call: one delta with id, type and name (arguments ""), then the
    arguments in pieces, all under the same index."""
    stream = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=0,
        max_tokens=100,
        stream=True,
    )
    content, calls, reason, deltas = _streamed(stream)
    assert reason == "tool_calls" and not content and len(calls) == 1
    first, rest = deltas[0], deltas[1:]
    assert first.id.startswith("call_") and first.type == "function" and first.function.name == "add"
    assert first.function.arguments == ""
    assert len(rest) >= 3 and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    jsonschema.validate(json.loads(calls[0]["arguments"]), ADD)


def test_response_format_with_forced_tool_choice_is_accepted(client):
    rf = {
        "type": "json_schema",
        "json_schema": {
            "name": "answer",
            "schema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        },
    }
    content, calls, reason = _answer(
        client,
        stream=False,
        model="default",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        response_format=rf,
        temperature=0,
        max_tokens=200,
    )
    assert reason == "tool_calls" and content is None and calls
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])


# -- the three formats, on fixed text and through the Runner ----------------------------------------


def test_parse_unterminated_hermes_calls():
    """A 0.5B model's answer: two <tool_call> blocks, neither closed."""
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}'
    content, calls = tool_parser.parse(text, "hermes")
    assert content is None and [json.loads(c.arguments) for c in calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    content, calls = tool_parser.parse('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', "hermes")
    assert content == "Sure." and [c.name for c in calls] == ["add"]


# Minimal templates whose text makes the server pick each format (as real Llama 3.1 and Mistral
# templates do), with the tools in the prompt.
FORMAT_TEMPLATES = {
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if tools %}<|im_start|>system\nCall a function: answer "
        '{"name": ..., "parameters": ...} (ipython, <|python_tag|>). {{ tools | tojson }}<|im_end|>\n'
        "{% endif %}<|im_start|>assistant\n"
    ),
    "mistral": (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if tools %}<|im_start|>system\n[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS] "
        "Answer [TOOL_CALLS] [...]<|im_end|>\n{% endif %}<|im_start|>assistant\n"
    ),
    "hermes": None,  # the model's own template
}


@pytest.fixture(scope="module")
def runner(smollm2_gguf_path):
    from pagedllm import Runner, Which

    return Runner(
        Which.GGUF(str(smollm2_gguf_path.parent), smollm2_gguf_path.name),
        max_seqs=8,
        pa_gpu_mem=128,
        max_model_len=1024,
    )


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_forced_calls_in_every_format_through_the_runner(runner, fmt):
    tok = runner.llm.tokenizer
    own = tok.chat_template
    if FORMAT_TEMPLATES[fmt] is not None:
        tok.chat_template = FORMAT_TEMPLATES[fmt]
    try:
        assert tool_api.detect_format(tok.chat_template) == fmt
        for i, (choice, parallel, stream) in enumerate(
            [
                ("required", True, False),
                ("required", False, True),
                ({"type": "function", "function": {"name": "get_weather"}}, True, True),
            ]
        ):
            req = dict(
                model="default",
                messages=ASK,
                tools=TOOLS,
                tool_choice=choice,
                parallel_tool_calls=parallel,
                temperature=0.9,
                seed=i,
                max_tokens=400,
                stream=stream,
            )
            if stream:
                text, calls = "", {}
                for chunk in runner.send_chat_completion_request(req):
                    d = chunk.choices[0].delta if chunk.choices else None
                    if d is None:
                        continue
                    text += d.content or ""
                    for tc in d.tool_calls or []:
                        c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                        c["name"] += tc.get("function", {}).get("name") or ""
                        c["arguments"] += tc.get("function", {}).get("arguments") or ""
                    reason = chunk.choices[0].finish_reason or None
                calls = [calls[k] for k in sorted(calls)]
            else:
                ch = runner.send_chat_completion_request(req).choices[0]
                text, reason = ch.message.content, ch.finish_reason
                calls = [c["function"] for c in ch.message.tool_calls or []]
            assert reason == "tool_calls" and not text and calls, (fmt, i, text, calls, reason)
            if not parallel or isinstance(choice, dict):
                assert len(calls) == 1
            for c in calls:
                jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])
    finally:
        tok.chat_template = own


QWEN = Path(
    os.environ.get(
        "PAGEDLLM_QWEN_GGUF", Path.home() / ".cache/pagedllm/models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    )
)


@pytest.mark.slow  # a real model file
@pytest.mark.skipif(
    not QWEN.is_file(),
    reason="opt-in: the Qwen2.5-Coder-0.5B GGUF (bash ../shared/models/fetch-qwen-coder.sh, or PAGEDLLM_QWEN_GGUF)",
)
def test_forced_calls_on_real_qwen_coder(tmp_path_factory):
    """The real Qwen2.5 template: <tool_call> is one added token there, which the grammar names."""
    gen = serving(
        tmp_path_factory,
        "qwen",
        ["--model", str(QWEN), "--pa-gpu-mem", "256", "--max-model-len", "2048", "--log-level", "info"],
    )
    srv = next(gen)
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        for i in range(20):
            named = i % 2 == 1
            choice = {"type": "function", "function": {"name": "get_weather"}} if named else "required"
            content, calls, reason = _answer(
                client,
                stream=i % 4 >= 2,
                model=model,
                messages=ASK,
                tools=TOOLS,
                tool_choice=choice,
                temperature=0.9,
                seed=i,
                max_tokens=300,
                parallel_tool_calls=i % 3 != 0,
            )
            assert reason == "tool_calls" and not content and calls, (i, content, calls, reason)
            for c in calls:
                jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])
    finally:
        gen.close()


# -- 4. completions logprobs ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_0_include_the_sampled_token(client, stream):
    kw = dict(model="default", prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=0)
    if stream:
        tokens, lps, tops = [], [], []
        for chunk in client.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                if ch.logprobs:
                    tokens += ch.logprobs.tokens
                    lps += ch.logprobs.token_logprobs
                    tops += ch.logprobs.top_logprobs
    else:
        lp = client.completions.create(**kw).choices[0].logprobs
        tokens, lps, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
    assert len(tokens) == 5 and len(tops) == 5
    for tok, v, top in zip(tokens, lps, tops):
        assert top == {tok: v}


@pytest.mark.parametrize("stream", [False, True])
def test_echo_of_token_id_prompt_holds_the_prompt_text(client, stream):
    kw = dict(model="default", prompt=[0, 0, 0, 0, 0], max_tokens=3, temperature=0, echo=True, logprobs=1)
    if stream:
        text, lp = "", {"tokens": [], "text_offset": [], "top_logprobs": [], "token_logprobs": []}
        for chunk in client.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                text += ch.text
                for k in lp:
                    lp[k] += getattr(ch.logprobs, k) if ch.logprobs else []
    else:
        ch = client.completions.create(**kw).choices[0]
        text, lp = ch.text, ch.logprobs.model_dump()
    tokens, offsets = lp["tokens"], lp["text_offset"]
    assert len(tokens) == 8 and text == "".join(tokens), (text, tokens)
    assert text.startswith("<|endoftext|>" * 5)
    # text_offset: where each token starts in `text`, so it only grows
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert lp["token_logprobs"][0] is None and all(v is not None for v in lp["token_logprobs"][1:])


# -- 5. logit_bias -----------------------------------------------------------------------------------


def test_logit_bias_moves_the_choice(client, smollm2_checkpoint):
    """-100 on the greedy token: the greedy answer takes the second most likely one (the model's
    own top_logprobs say which); +100 on a token: a sampled answer is that token every time."""
    tok = smollm2_checkpoint.tokenizer  # the GGUF the server reads
    kw = dict(model="default", prompt="The capital of France is", max_tokens=1, temperature=0, logprobs=2)
    plain = client.completions.create(**kw).choices[0]
    best, second = sorted(plain.logprobs.top_logprobs[0].items(), key=lambda kv: -kv[1])[:2]
    assert plain.text == best[0]
    ids = {t: tok.encode(t, add_special_tokens=False)[0] for t, _ in (best, second)}
    biased = client.completions.create(**{**kw, "logit_bias": {str(ids[best[0]]): -100}}).choices[0]
    assert biased.text == second[0]
    forced = client.completions.create(
        model="default",
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0.9,
        seed=1,
        logit_bias={str(ids[second[0]]): 100},
    )
    assert forced.choices[0].text == second[0] * 4
    chat = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0.9,
        seed=2,
        logit_bias={str(ids[second[0]]): 100},
    )
    assert chat.choices[0].message.content == second[0] * 3


@pytest.mark.parametrize("bias", [{"999999": 1}, {"abc": 1}, {"5": 100.5}, {"-3": 1}])
def test_bad_logit_bias_gets_400(client, bias):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt="Hi", max_tokens=2, logit_bias=bias)
    assert e.value.body["param"] == "logit_bias" and "logit_bias" in e.value.body["message"]


# -- 8. wire details --------------------------------------------------------------------------------


def _raw_chunks(server, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_stream_deltas_carry_only_what_they_hold(server):
    """No `role: null`, `tool_calls: null` or `content: null` in deltas, and the finish chunk's delta is
    empty, as OpenAI streams them; with tools too."""
    for body in (
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0},
        {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "temperature": 0},
    ):
        chunks = _raw_chunks(server, "chat/completions", {"model": "default", **body})
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert deltas[0] == {"role": "assistant", "content": ""}
        for d in deltas:
            assert None not in d.values(), d
            assert "role" not in d or d is deltas[0]
        finish = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(finish) == 1 and finish[0]["delta"] == {}, finish


STOPS = [  # (request fields, the stop_reason vLLM returns)
    ({"stop": [" Paris", "zzz"]}, " Paris"),
    ({"max_tokens": 2}, None),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", range(len(STOPS)))
def test_stop_reason_in_chat_and_completions(server, client, smollm2_checkpoint, stream, case):
    extra, want = STOPS[case]
    prompt = "The capital of France is"
    comp = dict(model="default", prompt=prompt, temperature=0, max_tokens=extra.get("max_tokens", 8))
    comp.update({k: v for k, v in extra.items() if k != "max_tokens"})
    chat = {**comp, "messages": [{"role": "user", "content": "What is the capital of France? Answer: The capital is"}]}
    del chat["prompt"]
    for path, body in (("completions", comp), ("chat/completions", chat)):
        if stream:
            choice = [
                c["choices"][0]
                for c in _raw_chunks(server, path, body)
                if c["choices"] and c["choices"][0]["finish_reason"]
            ][0]
        else:
            r = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=120)
            choice = r.json()["choices"][0]
        assert "stop_reason" in choice
        if path == "completions" or want is None:
            assert choice["stop_reason"] == want, (path, choice)
    # a stop token id: stop_reason is that id
    tok = smollm2_checkpoint.tokenizer
    paris = tok.encode(" Paris", add_special_tokens=False)[0]
    r = httpx.post(f"{server.url}/v1/completions", json={**comp, "stop": None, "stop_token_ids": [paris]}, timeout=120)
    assert r.json()["choices"][0]["stop_reason"] == paris
    assert r.json()["choices"][0]["finish_reason"] == "stop"


# -- 6. aborts ----------------------------------------------------------------------------------------

LONG = "Tell me a long story about a dragon, a knight and a wizard who live in a castle. " * 12


@pytest.mark.slow
def test_gone_clients_cost_the_next_request_nothing(server):
    """200 streaming clients that leave after their first token, then one new request: its time to
    first token is within 2x of the same request's on an idle server, and nothing is left running."""
    import asyncio
    import statistics
    import time

    url = server.url

    async def ttft(ac: httpx.AsyncClient, salt: str) -> float:
        t0 = time.perf_counter()
        body = {"model": "default", "prompt": salt + LONG, "max_tokens": 50, "temperature": 0, "stream": True}
        async with ac.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"text":"' in line and '"text":""' not in line:
                    return time.perf_counter() - t0
        raise AssertionError("no token")

    async def quitter(ac: httpx.AsyncClient, i: int) -> None:
        # Short, distinct prompts: a quitter's prefill is the test's cost, and its length proves
        # nothing (200 of them, over 12x the server's 16 slots, is what loads the abort path).
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": f"{i}: " + LONG[: 24 + i % 24]}],
            "max_tokens": 300,
            "stream": True,
        }
        async with ac.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    return  # leaving the block closes the connection

    async def main() -> tuple[list[float], float, dict]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=600, limits=limits) as ac:
            await ttft(ac, "warm up. ")
            idle = [await ttft(ac, f"{k}. ") for k in range(3)]
            await asyncio.gather(*[quitter(ac, i) for i in range(200)])
            after = await ttft(ac, "3. ")
            return idle, after, server.metrics()

    idle, after, m = asyncio.run(main())
    assert after <= 2 * statistics.median(idle), (idle, after)
    assert m["pagedllm_requests_aborted_total"] >= 200


def _quiet_metrics(server, settle_s: float = 0.5) -> dict:
    """The metrics once nothing runs or waits and the token count has stopped moving: a client
    that left the test before may still have a step in flight when its abort lands."""
    import time

    deadline = time.monotonic() + 120
    prev = None
    while time.monotonic() < deadline:
        m = server.metrics()
        quiet = m["pagedllm_num_requests_running"] == 0 and m["pagedllm_num_requests_waiting"] == 0
        if (
            quiet
            and prev is not None
            and prev["pagedllm_generation_tokens_total"] == m["pagedllm_generation_tokens_total"]
        ):
            return m
        prev = m if quiet else None
        time.sleep(settle_s)
    raise AssertionError(f"the server did not go quiet within 120 s: {m}")


@pytest.mark.slow
def test_client_gone_before_acceptance_costs_no_step(server):
    """Clients that leave while their requests wait to be accepted (the engine busy with a long
    prefill) never get a token computed: their abort goes in with their add."""
    import socket
    import threading
    import time

    host, port = server.url.removeprefix("http://").split(":")
    before = _quiet_metrics(server)
    # two ~760-token prompts: one prefill step of ~1500 tokens. A streamed answer's headers come
    # when its request is accepted, right before that step starts.
    busy = {"model": "default", "max_tokens": 3, "ignore_eos": True, "temperature": 0, "stream": True}
    started = [threading.Event(), threading.Event()]

    def run_busy(i: int) -> None:
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", timeout=300, json={**busy, "prompt": f"{i} " + LONG * 3}
        ) as r:
            started[i].set()
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=run_busy, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in started)
    socks = []
    for i in range(8):
        body = json.dumps({"model": "default", "prompt": f"gone {i}", "max_tokens": 5, "ignore_eos": True}).encode()
        s = socket.create_connection((host, int(port)))
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        socks.append(s)
    time.sleep(0.05)
    for s in socks:
        s.close()
    for t in threads:
        t.join()
    time.sleep(1.0)
    after = server.metrics()
    assert after["pagedllm_generation_tokens_total"] - before["pagedllm_generation_tokens_total"] == 2 * 3
