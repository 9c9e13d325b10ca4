"""The routes clients call beside generation (issue 23, failure 7): one model's card through the
`openai` client, vLLM's /tokenize and /detokenize (checked against transformers' tokenizer of
the same GGUF), /version, /openapi.json (checked with openapi-spec-validator), and CORS under
an API key (preflights are answered before the key check)."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from test_server import ServerProcess, free_port  # noqa: E402

KEY = "sk-routes"
ORIGIN = "https://app.example"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there, 2+2?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_gguf_path):
    port = free_port()
    srv = ServerProcess(
        [
            "serve",
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--allowed-origins",
            ORIGIN,
            "--served-model-name",
            "smol",
            "default",
            "--pa-gpu-mem",
            "64",
            "--max-model-len",
            "1024",
            "--log-level",
            "info",
        ],
        port,
        tmp_path_factory.mktemp("routes") / "server.log",
        KEY,
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
        assert "Traceback" not in srv.log(), srv.log()[-5000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _ids(encoded) -> list[int]:
    """apply_chat_template's ids (transformers 5 returns a BatchEncoding)."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60, **kw)


@pytest.mark.slow
def test_models_retrieve(client):
    for name in ("smol", "default"):  # the served name and its alias
        m = client.models.retrieve(name)
        assert m.id == name and m.object == "model" and m.owned_by == "pagedllm"
        assert m.model_extra["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    err = e.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model" and "smol" in err["message"]


def test_tokenize_prompt_as_transformers(server, hf_smollm2_tokenizer):
    text = "Hello world! Héllo, 東京 123 ok"
    want = hf_smollm2_tokenizer(text)["input_ids"]
    r = post(server, "/tokenize", {"model": "smol", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == want and body["count"] == len(want) and body["max_model_len"] == 1024
    assert body["token_strs"] == hf_smollm2_tokenizer.convert_ids_to_tokens(want)
    plain = post(server, "/tokenize", {"prompt": text}).json()
    assert plain["tokens"] == want and plain.get("token_strs") is None


def test_tokenize_messages_as_the_chat_route_and_transformers(server, client, hf_smollm2_tokenizer):
    body = post(server, "/tokenize", {"model": "smol", "messages": MESSAGES}).json()
    want = hf_smollm2_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    want = _ids(want)
    assert body["tokens"] == want and body["count"] == len(want)
    r = client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=1)
    assert r.usage.prompt_tokens == body["count"]  # what the chat route prefills
    no_prompt = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    want = hf_smollm2_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=True)
    want = _ids(want)
    assert no_prompt["tokens"] == want and no_prompt["count"] < body["count"]


def test_detokenize_as_transformers(server, hf_smollm2_tokenizer):
    ids = hf_smollm2_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = _ids(ids)
    r = post(server, "/detokenize", {"model": "smol", "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": hf_smollm2_tokenizer.decode(ids)}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ("/tokenize", {"prompt": "x", "model": "nope"}, "model"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_tokenize_bad_input(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err


def test_version(server):
    import pagedllm

    r = httpx.get(f"{server.url}/version", headers=AUTH)
    assert r.status_code == 200 and r.json() == {"version": pagedllm.__version__}


def test_openapi_document_is_valid(server):
    validator = pytest.importorskip("openapi_spec_validator")
    r = httpx.get(f"{server.url}/openapi.json", headers=AUTH)
    assert r.status_code == 200, r.text
    doc = r.json()
    validator.validate(doc)  # raises on an invalid OpenAPI document
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/models/{model_id}",
        "/tokenize",
        "/detokenize",
        "/version",
    ):
        assert path in doc["paths"], sorted(doc["paths"])
    body = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/TokenizeRequest"}
    assert "prompt" in doc["components"]["schemas"]["TokenizeRequest"]["properties"]


def test_cors_preflight_before_the_key_check(server):
    pre = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = httpx.options(f"{server.url}/v1/chat/completions", headers=pre)  # no key: a browser sends none
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    # The page can read the answers, errors included.
    ok = httpx.get(f"{server.url}/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    denied = httpx.get(f"{server.url}/v1/models", headers={"Origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    # Another origin gets no grant, and still needs the key.
    other = httpx.options(f"{server.url}/v1/chat/completions", headers={**pre, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert httpx.get(f"{server.url}/v1/models", headers={"Origin": "https://evil.example"}).status_code == 401


def test_embeddings_on_a_generative_model_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="smol", input="hello")
    err = e.value.body
    assert err["param"] == "model" and "generative model" in err["message"] and "--task embed" in err["message"]
