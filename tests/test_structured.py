"""Structured output (issue 12), checked with the real `openai` client and `jsonschema`.

Every request samples at temperature 0.9 from the default model, so only the grammar can
make the output valid: 50 json_schema requests (half streamed), regex, choice, Lark, and the
bad inputs that must get a 400 while the server keeps serving.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from pagedllm.structured import StructuredOutputs  # noqa: E402
from test_server import serving  # noqa: E402

FORMATS = jsonschema.FormatChecker(["date", "email", "ipv4", "uuid"])

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "email": {"type": "string", "format": "email", "maxLength": 40},
            "born": {"type": "string", "format": "date"},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        },
        "required": ["name", "age", "email", "born", "address", "tags"],
        "additionalProperties": False,
    },
    "inventory": {
        "type": "array",
        "minItems": 2,
        "maxItems": 4,
        "items": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                "status": {"enum": ["in", "out", "backorder"]},
            },
            "required": ["sku", "qty", "status"],
            "additionalProperties": False,
        },
    },
    "server": {
        "type": "object",
        "properties": {
            "host": {"type": "string", "format": "ipv4"},
            "port": {"type": "integer", "minimum": 1024, "maximum": 65535},
            "id": {"type": "string", "format": "uuid"},
            "debug": {"type": "boolean"},
            "mode": {"enum": ["dev", "prod"]},
        },
        "required": ["host", "port", "id", "debug", "mode"],
        "additionalProperties": False,
    },
    "answer": {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 60},
            # A number's digits are unbounded; sampled at 0.9 one ran 400 digits to
            # "length" once. multipleOf bounds them, as a user would (1/4: exact in
            # binary, so jsonschema's float check agrees).
            "confidence": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
            "sources": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2},
        },
        "required": ["answer", "confidence", "sources"],
        "additionalProperties": False,
    },
    "levels": {
        "type": "object",
        "properties": {
            "level": {"type": "integer", "minimum": -5, "maximum": 5},
            "nested": {
                "type": "object",
                "properties": {
                    "deeper": {
                        "type": "object",
                        "properties": {"ok": {"type": "boolean"}},
                        "required": ["ok"],
                        "additionalProperties": False,
                    }
                },
                "required": ["deeper"],
                "additionalProperties": False,
            },
        },
        "required": ["level", "nested"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def started_server(tmp_path_factory, smollm2_gguf_path):
    yield from serving(
        tmp_path_factory,
        "structured",
        ["--pa-gpu-mem", "512", "--max-model-len", "1024", "--max-seqs", "64", "--log-level", "info"],
    )


@pytest.fixture
def server(started_server):
    return started_server.get()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


def _ask(client, name: str, stream: bool, seed: int) -> tuple[str, str]:
    kw = dict(
        model="default",
        temperature=0.9,
        seed=seed,
        max_tokens=400,
        messages=[{"role": "user", "content": f"Give me a {name} record as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}},
    )
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        return c.message.content, c.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


@pytest.mark.slow
def test_50_json_schema_requests_validate(client):
    jobs = [(name, i % 2 == 1, i) for i, name in enumerate(list(SCHEMAS) * 10)]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: _ask(client, *j), jobs))
    for (name, stream, seed), (text, reason) in zip(jobs, results):
        assert reason == "stop", (name, stream, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name], format_checker=FORMATS)
    assert len({t for t, _ in results}) > 25  # sampled, not one fixed answer


@pytest.mark.slow
def test_regex_choice_and_json_object(client):
    msg = [{"role": "user", "content": "Write something."}]
    regex = r"[A-Z][a-z]{2,8} [0-9]{2,4}(\.[0-9])?"
    choices = ["alpha", "beta gamma", "δelta"]
    for i in range(6):
        stream = i % 2 == 1
        extra = [
            {"structured_outputs": {"regex": regex}},
            {"guided_regex": regex},
            {"structured_outputs": {"choice": choices}},
            {"guided_choice": choices},
        ][i % 4]
        kw = dict(model="default", messages=msg, temperature=0.9, seed=i, max_tokens=50, extra_body=extra)
        if stream:
            text = "".join(
                c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices
            )
        else:
            text = client.chat.completions.create(**kw).choices[0].message.content
        if "regex" in str(extra):
            assert re.fullmatch(regex, text), text
        else:
            assert text in choices, text
    # Any object: its strings are unbounded, so a sample may run out of tokens; those that end must parse.
    outs = [
        client.completions.create(
            model="default",
            prompt="A JSON object:",
            temperature=0.7,
            seed=s,
            max_tokens=300,
            extra_body={"response_format": {"type": "json_object"}},
        ).choices[0]
        for s in range(4)
    ]
    ended = [o for o in outs if o.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(o.text), dict) for o in ended), outs


def test_grammar_that_never_finishes_stops_at_max_tokens(client):
    r = client.completions.create(
        model="default",
        prompt="Letters:",
        temperature=0.9,
        max_tokens=12,
        extra_body={"structured_outputs": {"grammar": 'start: ("a" | "b") start'}},
    )
    assert r.choices[0].finish_reason == "length"
    assert re.fullmatch("[ab]+", r.choices[0].text) and r.usage.completion_tokens == 12


BAD = {
    "invalid_regex": {"structured_outputs": {"regex": "(unclosed"}},
    "impossible_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "schema": {
                    "type": "object",
                    "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 2}},
                    "required": ["n"],
                },
            },
        }
    },
    "schema_not_an_object": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
    "unsupported_keyword": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
        }
    },
    "bad_lark": {"structured_outputs": {"grammar": "start: missing_rule"}},
    "two_constraints": {"structured_outputs": {"regex": "a", "choice": ["a"]}},
    "empty_choice": {"guided_choice": []},
    "unknown_format_type": {"response_format": {"type": "yaml"}},
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_constraint_gets_400_and_server_keeps_serving(server, client, name):
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **BAD[name]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and "Traceback" not in r.text
    assert client.chat.completions.create(
        model="default", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    ).choices


def test_python_api_structured(tiny_llm_structured):
    from pagedllm import SamplingParams

    llm = tiny_llm_structured
    schema = SCHEMAS["levels"]
    outs = llm.generate(
        ["Some JSON:"] * 2,
        SamplingParams(n=2, temperature=1.0, max_tokens=120, seed=1, structured=StructuredOutputs(json=schema)),
        use_tqdm=False,
    )
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)
    out = llm.generate(
        "Pick:",
        SamplingParams(temperature=1.0, max_tokens=10, structured={"choice": ["left", "right"]}),
        use_tqdm=False,
    )
    assert out[0].outputs[0].text in ("left", "right")
    with pytest.raises(ValueError, match="regex"):
        llm.generate("x", SamplingParams(structured={"regex": "(a"}), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured={})


@pytest.fixture(scope="module")
def tiny_llm_structured(smollm2_gguf_path):
    from pagedllm import LLM

    return LLM("default", max_model_len=512, kv_cache_memory_mb=64, max_num_seqs=8)


def test_unpacked_mask_equals_llguidance_logit_bias(smollm2_checkpoint):
    import torch

    from pagedllm.structured.grammar import GrammarEngine, allowed_tokens

    eng = GrammarEngine(smollm2_checkpoint.tokenizer, 49152, [0, 2])
    for spec in ({"regex": "[a-f]{2,}[0-9]"}, {"json": SCHEMAS["server"]}, {"choice": ["yes", "no"]}):
        m = eng.compile(StructuredOutputs.coerce(spec))
        for _ in range(3):
            bitmask = torch.full((1, 49152 // 32), -1, dtype=torch.int32)
            m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
            bias = torch.frombuffer(bytearray(m.compute_logit_bias()), dtype=torch.uint8)
            banned = ~allowed_tokens(bitmask, 49152)[0]
            assert torch.equal(banned, bias == 0) and 0 < int((~banned).sum()) < 49152
            allowed = torch.nonzero(~banned).flatten().tolist()
            assert m.consume_token(allowed[len(allowed) // 2])
