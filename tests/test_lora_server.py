"""LoRA adapters through `pagedllm serve`, driven by the real `openai` client (httpx for the
non-OpenAI load/unload routes): each stream matches the offline LLM's answer for its adapter."""

from __future__ import annotations

import asyncio

import pytest

from models import build_checkpoint
from test_server import serving, wait_idle

pytest.importorskip("peft")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from lora_adapters import make_adapter  # noqa: E402

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_TOKENS = 24
LONG = 400  # the request an unload overlaps


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, hf_smollm2_tokenizer):
    """The base model, two served adapters, a spare one, one of rank 16 (above the server's 8),
    one for another base shape, prompts and the offline answers {model name: [text per prompt]}."""
    from pagedllm import LLM, LoRARequest, SamplingParams

    tok = hf_smollm2_tokenizer
    root = tmp_path_factory.mktemp("lora-serve")
    base = build_checkpoint("llama", root / "base", tok, len(tok))
    ad = {
        "a0": make_adapter(base, root / "a0", 1, 8, 16, False, TARGETS),
        "a1": make_adapter(base, root / "a1", 2, 4, 8, True, ["q_proj", "v_proj", "down_proj"]),
        "a2": make_adapter(base, root / "a2", 3, 8, 8, False, TARGETS),
    }
    big = make_adapter(base, root / "big", 4, 16, 16, False, ["q_proj"])
    other = build_checkpoint("llama", root / "other", tok, len(tok), hidden_size=96)
    wrong = make_adapter(other, root / "wrong", 5, 4, 8, False, ["q_proj"])
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    llm = LLM(str(base), dtype="float32", kv_cache_memory_mb=32, enable_lora=True, max_loras=3, max_lora_rank=8)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = {"base": [o.outputs[0].text for o in llm.generate(prompts, sp, use_tqdm=False)]}
    for i, (name, path) in enumerate(ad.items()):
        outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=LoRARequest(name, i + 1, str(path)))
        want[name] = [o.outputs[0].text for o in outs]
    long = SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True)
    want["a2-long"] = (
        llm.generate(prompts[2], long, use_tqdm=False, lora_request=LoRARequest("a2", 3, str(ad["a2"])))[0]
        .outputs[0]
        .text
    )
    assert len({tuple(want[k]) for k in ("base", "a0", "a1", "a2")}) == 4, "the adapters must change the answers"
    return base, ad, big, wrong, prompts, want


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, lora_setup):
    base, ad, *_ = lora_setup
    yield from serving(
        tmp_path_factory,
        "lora-serve",
        [
            str(base),
            "--served-model-name",
            "base",
            "--dtype",
            "float32",
            "--pa-gpu-mem",
            "32",
            "--enable-lora",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "8",
            "--lora-modules",
            f"a0={ad['a0']}",
            f"a1={ad['a1']}",
            "--allow-runtime-lora",
            "--log-level",
            "info",
        ],
    )


@pytest.fixture
def client(lora_server):
    return openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="x", max_retries=0, timeout=300)


def _complete(client, model: str, prompt: str) -> str:
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def test_models_lists_adapters_with_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "a0", "a1"}
    assert cards["a0"].model_extra["parent"] == "base" and cards["a1"].model_extra["parent"] == "base"
    assert (cards["base"].model_extra or {}).get("parent") is None


def test_concurrent_streams_match_offline(lora_server, lora_setup):
    """Two adapters and the base, every prompt, all streaming at once."""
    _, _, _, _, prompts, want = lora_setup
    ac = openai.AsyncOpenAI(base_url=f"{lora_server.url}/v1", api_key="x", max_retries=0, timeout=300)

    async def one(model: str, prompt: str) -> str:
        stream = await ac.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        jobs = [(m, j) for m in ("base", "a0", "a1") for j in range(len(prompts))]
        texts = await asyncio.gather(*(one(m, prompts[j]) for m, j in jobs))
        return {job: t for job, t in zip(jobs, texts)}

    got = asyncio.run(main())
    for (m, j), text in got.items():
        assert text == want[m][j], f"{m} prompt {j}"
    wait_idle(lora_server)


def test_unknown_adapter_is_404(client):
    with pytest.raises(openai.NotFoundError, match="the model `nope` does not exist"):
        _complete(client, "nope", "hi")


def test_routes_without_adapters_refuse_an_adapter_name(client):
    """/v1/responses runs the base model only: an adapter's name is refused, not answered by the base."""
    with pytest.raises(openai.BadRequestError, match="`a0` is a LoRA adapter"):
        client.responses.create(model="a0", input="hi", max_output_tokens=4)


def test_runtime_load_refusals_name_the_mismatch(lora_server, lora_setup):
    _, _, big, wrong, _, _ = lora_setup
    url = f"{lora_server.url}/v1/load_lora_adapter"
    r = httpx.post(url, json={"lora_name": "big", "lora_path": str(big)}, timeout=60)
    assert r.status_code == 400 and "rank 16, above max_lora_rank=8" in r.json()["error"]["message"]
    r = httpx.post(url, json={"lora_name": "wrong", "lora_path": str(wrong)}, timeout=60)
    assert r.status_code == 400
    assert "takes 64 inputs: the adapter is for another base model" in r.json()["error"]["message"]
    assert (
        httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", json={"lora_name": "nope"}, timeout=60).status_code
        == 404
    )


def test_runtime_load_use_unload(lora_server, lora_setup, client):
    """A third adapter loaded at runtime (two slots: the LRU evicts), used, and unloaded while
    a request runs with it: that request finishes with its adapter's answer, the name then 404s,
    and no block is left held."""
    _, ad, _, _, prompts, want = lora_setup
    r = httpx.post(
        f"{lora_server.url}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(ad["a2"])}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert "a2" in {m.id for m in client.models.list().data}
    assert _complete(client, "a2", prompts[0]) == want["a2"][0]
    assert _complete(client, "a0", prompts[1]) == want["a0"][1]
    stream = client.completions.create(
        model="a2", prompt=prompts[2], max_tokens=LONG, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = []
    for c in stream:
        if c.choices:
            chunks.append(c.choices[0].text)
        if len(chunks) == 1:  # the request is running: unload its adapter now
            r = httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", json={"lora_name": "a2"}, timeout=60)
            assert r.status_code == 200, r.text
            assert "a2" not in {m.id for m in client.models.list().data}
    assert len(chunks) > 20 and "".join(chunks) == want["a2-long"]
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a2", prompts[0])
    assert "a2" not in {m.id for m in client.models.list().data}
    wait_idle(lora_server)
