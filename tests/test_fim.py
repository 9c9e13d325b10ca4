"""Fill-in-the-middle prompts (pagedllm/protocols/fim.py) against transformers' tokenizer on the
real Qwen2.5-Coder GGUF (skipped without the file), laid out as the model card writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.protocols import fim
from pagedllm.protocols.common.context import ServingContext
from pagedllm.protocols.common.errors import ApiError

QWEN = Path.home() / ".cache/pagedllm/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
PREFIX = "def mean(xs):\n    total = 0\n    for x in xs:\n"
SUFFIX = "    return total / len(xs)\n"
FILES = [
    fim.InfillFile(filename="util/stats.py", text="import math\n\nPI = math.pi\n"),
    fim.InfillFile(filename="README.md", text="# stats\n"),
]


def _ctx(tokenizer) -> ServingContext:
    return ServingContext(
        tokenizer=tokenizer, model_name="m", max_model_len=4096, block_size=16, usable_blocks=64, max_n=1
    )


@pytest.fixture(scope="module")
def qwen():
    if not QWEN.is_file():
        pytest.skip(f"{QWEN} is not here")
    transformers = pytest.importorskip("transformers")
    from pagedllm.loading.gguf import read_gguf

    ours = read_gguf(QWEN).tokenizer
    hf = transformers.AutoTokenizer.from_pretrained(str(QWEN.parent), gguf_file=QWEN.name)
    return ours, hf


@pytest.mark.slow  # a real model file
def test_plain_fim_ids_equal_transformers(qwen):
    ours, hf = qwen
    ids = fim.infill_ids(_ctx(ours), PREFIX, SUFFIX)
    ref = hf(f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>", add_special_tokens=False)
    assert ids == ref["input_ids"]


@pytest.mark.slow  # a real model file
def test_repo_level_ids_equal_the_model_cards_layout(qwen):
    ours, hf = qwen
    ids = fim.infill_ids(_ctx(ours), PREFIX, SUFFIX, FILES, repo_name="stats", filename="stats/mean.py")
    text = (
        "<|repo_name|>stats\n<|file_sep|>util/stats.py\nimport math\n\nPI = math.pi\n"
        "<|file_sep|>README.md\n# stats\n<|file_sep|>stats/mean.py\n"
        f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    )
    assert ids == hf(text, add_special_tokens=False)["input_ids"]


@pytest.mark.slow  # a real model file
def test_typing_keeps_the_prompt_head(qwen):
    """One more keystroke changes only the prompt's tail: the files and the prefix before the
    cursor stay the same leading tokens, which the prefix cache keeps."""
    ours, _ = qwen
    a = fim.infill_ids(_ctx(ours), PREFIX, SUFFIX, FILES)
    b = fim.infill_ids(_ctx(ours), PREFIX + "        total +", SUFFIX, FILES)
    head = fim.infill_ids(_ctx(ours), PREFIX, "", FILES)[:-3]  # up to the prefix's end
    assert a[: len(head)] == b[: len(head)] == head


class _Vocab:
    """A tokenizer with no FIM spelling; GGUF metadata may still name the tokens."""

    add_bos_token, bos_token_id = False, None

    def __init__(self, fim_token_ids=None):
        self.fim_token_ids = fim_token_ids or {}

    def token_to_id(self, token):
        return None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_gguf_metadata_ids_win_and_no_tokens_is_a_clear_400():
    tk = _Vocab({"pre": 1, "suf": 2, "mid": 3})
    assert fim.infill_ids(_ctx(tk), "a", "b") == [1, ord("a"), 2, ord("b"), 3]
    with pytest.raises(ApiError) as e:
        fim.infill_ids(_ctx(_Vocab()), "a", "b")
    assert e.value.status == 400 and "fill-in-the-middle tokens" in e.value.message


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory):
    from test_server import serving_qwen

    yield from serving_qwen(tmp_path_factory, "fim")


@pytest.mark.slow  # a real model file
def test_infill_streamed_and_not_agree_with_completions_suffix(fim_server):
    """/infill (whole, and streamed as llama.cpp streams it), /v1/completions with `suffix`
    through the openai client and /api/generate with `suffix` through the ollama client give
    the same greedy middle on the real model."""
    httpx = pytest.importorskip("httpx")
    openai = pytest.importorskip("openai")
    ollama = pytest.importorskip("ollama")
    server = fim_server.get()
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "temperature": 0, "n_predict": 24}
    whole = httpx.post(f"{server.url}/infill", json=body, timeout=300).json()
    assert whole["stop"] and whole["content"] and whole["tokens_predicted"] >= 1
    events = []
    with httpx.stream("POST", f"{server.url}/infill", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: ")
                events.append(json.loads(line[len("data: ") :]))
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True] and len(events) > 2
    assert "".join(e["content"] for e in events) == whole["content"]
    last = events[-1]
    assert (last["stop_type"], last["tokens_predicted"], last["tokens_evaluated"]) == (
        whole["stop_type"],
        whole["tokens_predicted"],
        whole["tokens_evaluated"],
    )
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
    comp = client.completions.create(
        model="qwen", prompt=PREFIX, temperature=0, max_tokens=24, extra_body={"suffix": SUFFIX}
    )
    assert comp.choices[0].text == whole["content"] and comp.usage.prompt_tokens == whole["tokens_evaluated"]
    gen = ollama.Client(host=server.url, timeout=300).generate(
        model="qwen", prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": 24}
    )
    assert gen.response == whole["content"]
    print("\nmiddle:", repr(whole["content"]), whole["stop_type"], len(events), "events")
