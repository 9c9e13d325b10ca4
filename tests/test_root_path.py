"""--root-path (issue 66.5): behind a reverse proxy that serves pagedllm under a path prefix and
strips it before forwarding (uvicorn's and FastAPI's root_path semantics, as vLLM's
--root-path), the routes answer as forwarded, /openapi.json names the prefix as its server, and
the paths the key check treats apart (/health open, /v1/messages' error shape) still are."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from test_server import serving  # noqa: E402

KEY = "sk-root"
PREFIX = "/llm"


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_gguf_path):
    # /health, which the start waits on, is open behind the prefix too (or the start times out)
    yield from serving(
        tmp_path_factory,
        "root_path",
        [
            "--api-key",
            KEY,
            "--root-path",
            PREFIX + "/",
            "--served-model-name",
            "smol",
            "--pa-gpu-mem",
            "64",
            "--max-model-len",
            "512",
            "--log-level",
            "info",
        ],
    )


def test_routes_answer_as_the_proxy_forwards_them(server):
    # the proxy took the prefix off: the client's .../llm/v1/... arrives as /v1/...
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == ["smol"]
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.choices[0].message.content is not None and r.usage.completion_tokens >= 1
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # open, as without a prefix
    assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 401


def test_openapi_names_the_prefix(server):
    doc = httpx.get(f"{server.url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert doc["servers"] == [{"url": PREFIX}]
    assert "/v1/chat/completions" in doc["paths"] and not any(p.startswith(PREFIX) for p in doc["paths"])


def test_anthropic_errors_keep_their_shape(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="smol", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
