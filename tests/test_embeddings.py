"""Embeddings (issue 23, failure 7 and acceptance 3): random-weight Qwen3 embedding folders in
Qwen3-Embedding's layout (a head-less `Qwen3Model`, a tokenizer that appends <|endoftext|>,
sentence-transformers' modules.json, 1_Pooling/config.json and instruction prompts), embedded by
`pagedllm serve` through the `openai` client and by `LLM.embed`, against sentence-transformers
on the same folder: cosine >= 0.9999 for every text, in batches of 1 to 64 texts of mixed length."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
st = pytest.importorskip("sentence_transformers")

from test_server import serving  # noqa: E402

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
WORDS = (
    "paged attention keeps the cache in blocks so many requests share memory without waste ; "
    "Paris est la capitale de la France . 東京 は 日本 の 首都 です 🙂 12345 6.02e23 "
    "def f(x): return x * 2 \n the quick brown fox jumps over the lazy dog"
).split(" ")
BATCHES = (1, 2, 5, 16, 33, 64)
MIN_COSINE = 0.9999


def texts(n: int, seed: int) -> list[str]:
    """n texts of mixed length (1 to ~250 words), deterministic."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 8, 20, 60, 120, 250]))) for _ in range(n)]


def build_embedding_folder(out: Path, tok, pooling: str = "lasttoken", normalize: bool = True, seed: int = 0) -> Path:
    import tokenizers
    import transformers as tf

    cfg = tf.Qwen3Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    model = tf.Qwen3Model(cfg).to(torch.float32)
    with torch.no_grad():  # random norms, so a misread q/k or final norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    model.save_pretrained(out)
    tok.padding_side = "left"  # Qwen3-Embedding's
    if tok.pad_token is None:
        tok.pad_token = "<|endoftext|>"
    tok.save_pretrained(out)
    # Qwen3-Embedding's tokenizer appends <|endoftext|> (not its EOS): the last-token pooling reads it.
    tk = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    eot = tk.token_to_id("<|endoftext|>")
    tk.post_processor = tokenizers.processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1", special_tokens=[("<|endoftext|>", eot)]
    )
    tk.save(str(out / "tokenizer.json"))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir()
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    modes = {
        f"pooling_mode_{m}": m == pooling
        for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    }
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **modes, "include_prompt": True})
    )
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 1024, "do_lower_case": False}))
    (out / "config_sentence_transformers.json").write_text(
        json.dumps(
            {
                "prompts": {"query": QUERY_PROMPT, "document": ""},
                "default_prompt_name": None,
                "similarity_fn_name": "cosine",
            }
        )
    )
    return out


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory, hf_smollm2_tokenizer):
    import copy

    return build_embedding_folder(tmp_path_factory.mktemp("qwen3-embedding"), copy.deepcopy(hf_smollm2_tokenizer))


@pytest.fixture(scope="module")
def reference(qwen3_embedding):
    return st.SentenceTransformer(str(qwen3_embedding), device="cpu")


@pytest.fixture(scope="module")
def server(tmp_path_factory, qwen3_embedding):
    # A small batch budget: long inputs are prefilled in several chunks.
    yield from serving(
        tmp_path_factory,
        "embed",
        [
            str(qwen3_embedding),
            "--task",
            "embed",
            "--dtype",
            "float32",
            "--pa-gpu-mem",
            "64",
            "--max-num-batched-tokens",
            "512",
            "--log-level",
            "info",
        ],
    )


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def cosines(ours, ref) -> list[float]:
    a = torch.tensor(ours, dtype=torch.float64)
    b = torch.tensor(ref, dtype=torch.float64)
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()


def test_reference_reads_the_layout(reference, qwen3_embedding):
    """The folder is what sentence-transformers takes for Qwen3-Embedding (checks the test's own setup)."""
    names = [type(m).__name__ for m in reference]
    assert names == ["Transformer", "Pooling", "Normalize"]
    assert reference[1].pooling_mode == "lasttoken"
    ids = reference.tokenize(["hello"])["input_ids"][0].tolist()
    assert ids[-1] == reference.tokenizer.convert_tokens_to_ids("<|endoftext|>")


@pytest.mark.parametrize("batch", BATCHES)
def test_openai_client_matches_sentence_transformers(client, model_id, reference, batch):
    inputs = texts(batch, seed=batch)
    r = client.embeddings.create(model=model_id, input=inputs)
    assert [d.index for d in r.data] == list(range(batch))
    want = reference.encode(inputs, batch_size=batch, convert_to_numpy=True)
    cos = cosines([d.embedding for d in r.data], want)
    print(f"batch {batch}: min cosine {min(cos):.8f}")  # (pytest -s shows it)
    assert min(cos) >= MIN_COSINE, sorted(cos)[:3]
    norms = torch.tensor([d.embedding for d in r.data]).norm(dim=-1)
    assert torch.allclose(norms, torch.ones(batch), atol=1e-4)
    n_tokens = sum(len(reference.tokenize([t])["input_ids"][0]) for t in inputs)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n_tokens


def test_instruction_prompt_and_float_format(server, reference):
    inputs = texts(9, seed=99)
    body = {"input": inputs, "prompt_name": "query", "encoding_format": "float"}
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=120)
    assert r.status_code == 200, r.text
    ours = [d["embedding"] for d in r.json()["data"]]
    want = reference.encode(inputs, prompt_name="query", batch_size=9)
    assert min(cosines(ours, want)) >= MIN_COSINE
    plain = reference.encode(inputs, batch_size=9)
    assert max(cosines(ours, plain)) < 0.9999  # the instruction changes the embedding


def test_token_ids_and_dimensions(client, model_id, reference):
    ids = reference.tokenize(["paged attention"])["input_ids"][0].tolist()
    r = client.embeddings.create(model=model_id, input=ids)
    want = reference.encode(["paged attention"])
    assert min(cosines([r.data[0].embedding], want)) >= MIN_COSINE
    short = client.embeddings.create(model=model_id, input="paged attention", dimensions=16)
    v = torch.tensor(short.data[0].embedding)
    assert v.shape == (16,) and abs(float(v.norm()) - 1) < 1e-5
    head = torch.nn.functional.normalize(torch.tensor(want[0][:16]), dim=-1)
    assert float(v @ head) >= MIN_COSINE


def test_concurrent_requests_batch_together(server, reference):
    import concurrent.futures as cf

    groups = [texts(6, seed=200 + i) for i in range(6)]
    with cf.ThreadPoolExecutor(6) as pool:
        rs = list(pool.map(lambda g: httpx.post(f"{server.url}/v1/embeddings", json={"input": g}, timeout=120), groups))
    for g, r in zip(groups, rs):
        assert r.status_code == 200, r.text
        want = reference.encode(g, batch_size=6)
        assert min(cosines([d["embedding"] for d in r.json()["data"]], want)) >= MIN_COSINE


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({"input": "x", "prompt_name": "nope"}, "prompt_name"),
        ({"input": "x", "dimensions": 65}, "dimensions"),
        ({"input": [[1, 2], [10**9]]}, "input"),
        ({"input": "word " * 1100}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_requests(server, body, param):
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_generation_on_an_embedding_model_is_refused(client, model_id):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}])
    assert "embedding model" in e.value.body["message"]


@pytest.mark.parametrize("pooling, normalize", [("mean_tokens", False), ("cls_token", True), ("lasttoken", False)])
def test_llm_embed_pooling_modes(tmp_path, hf_smollm2_tokenizer, pooling, normalize):
    """Mean and CLS pooling (and no Normalize module) through LLM.embed, detected from the folder
    (task "auto"), with a batch budget that splits long inputs over several forwards."""
    import copy

    from pagedllm import LLM

    folder = build_embedding_folder(tmp_path / pooling, copy.deepcopy(hf_smollm2_tokenizer), pooling, normalize, seed=3)
    ref = st.SentenceTransformer(str(folder), device="cpu")
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_mb=16, max_num_batched_tokens=128)
    assert llm.task == "embed"
    inputs = texts(20, seed=7)
    ours = llm.embed(inputs)
    want = ref.encode(inputs, batch_size=20)
    assert min(cosines(ours, want)) >= MIN_COSINE
    if not normalize:  # the raw vectors, not only their directions
        assert torch.allclose(torch.tensor(ours), torch.tensor(want), rtol=1e-3, atol=1e-3)


def test_llm_embed_is_scheduled_work_chunked_queued_and_preempted(tmp_path, hf_smollm2_tokenizer):
    """Embeddings are the scheduler's work (issue 24): every forward is one `execute` of a
    scheduled step within the batch budget, inputs the KV cache cannot hold together wait for
    room, and a mean-pooled input preempted halfway (its blocks taken back, its prefill
    recomputed) is still exact: the positions it pooled are not counted twice. Every block
    comes back."""
    import copy

    from pagedllm import LLM

    folder = build_embedding_folder(
        tmp_path / "mean", copy.deepcopy(hf_smollm2_tokenizer), "mean_tokens", normalize=False, seed=5
    )
    ref = st.SentenceTransformer(str(folder), device="cpu")
    # 1 MiB of float32 KV is 42 blocks of 32 tokens: about half of the inputs' 2,300 tokens.
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_mb=1, max_num_batched_tokens=96)
    engine, sched = llm.engine, llm.engine.scheduler
    bm = engine.block_manager
    free0 = bm.num_free_blocks
    steps: list[int] = []
    execute, schedule = engine.runner.execute, sched.schedule

    def recorded(batch, *args):
        steps.append(sum(it.num_new_tokens for it in batch))
        return execute(batch, *args)

    def preempting():  # the scheduler's own preemption, of a long input halfway through its prefill
        out = schedule()
        for it in out.scheduled:
            if len(out.scheduled) > 1 and it.seq.num_computed_tokens > 100 and it.seq.num_preemptions == 0:
                out.scheduled.remove(it)
                sched._preempt(it.seq)
                out.preempted.append(it.seq)
                break
        return out

    engine.runner.execute, sched.schedule = recorded, preempting
    inputs = texts(16, seed=11) + [" ".join(WORDS * 3)]
    ours = llm.embed(inputs)
    want = ref.encode(inputs, batch_size=len(inputs))
    assert torch.allclose(torch.tensor(ours), torch.tensor(want), rtol=1e-3, atol=1e-3)
    n_tokens = sum(len(ids) for ids in llm.embed_ids(inputs))
    assert max(steps) <= 96 and sum(steps) > n_tokens  # chunked to the budget; the recompute adds
    assert sched.num_preemptions >= 3
    assert bm.num_free_blocks == free0 and not engine.requests and not sched.has_unfinished()
