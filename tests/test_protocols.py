"""The protocol package's own seams: prompts tokenized once and off the engine thread, one owner
for chat templating, one GPT-2 byte table (checked against transformers')."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pagedllm.protocols.common.context import ServingContext
from pagedllm.protocols.common.tokens import TokenText
from pagedllm.protocols.openai.calls import completion_call
from pagedllm.protocols.openai.models import CompletionRequest

ROOT = Path(__file__).resolve().parents[1] / "pagedllm"


class CountingTokenizer:
    """The real tokenizer, counting its encode calls."""

    def __init__(self, tok) -> None:
        self.tok, self.encodes = tok, 0

    def encode(self, *args, **kwargs):
        self.encodes += 1
        return self.tok.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.fixture(scope="module")
def llm():
    from pagedllm import LLM

    return LLM("default", kv_cache_memory_mb=64, enable_prefix_caching=False)


def _ctx(llm, tok) -> ServingContext:
    ctx = ServingContext.from_llm(llm)
    ctx.tokenizer = tok
    return ctx


@pytest.mark.parametrize("max_tokens", [None, 5])
def test_completion_text_prompts_reach_the_engine_as_ids_tokenized_once(llm, hf_smollm2_tokenizer, max_tokens):
    tok = CountingTokenizer(llm.tokenizer)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    req = CompletionRequest(prompt=prompts, max_tokens=max_tokens, temperature=0.0, echo=True)
    call = completion_call(req, _ctx(llm, tok), TokenText(llm.tokenizer))
    assert tok.encodes == len(prompts)  # once each, while the request is prepared
    # The engine gets token ids (so its thread never tokenizes), the ones transformers' tokenizer gives.
    assert [it[1] for it in call.items] == [hf_smollm2_tokenizer.encode(p) for p in prompts]


def test_completion_engine_thread_never_tokenizes(llm, monkeypatch):
    req = CompletionRequest(prompt="Once upon a time", max_tokens=6, temperature=0.0, echo=True)
    want = llm.generate(["Once upon a time"], _greedy(6), use_tqdm=False)[0].outputs[0].text
    call = completion_call(req, ServingContext.from_llm(llm), TokenText(llm.tokenizer))

    def refuse(*_, **__):
        raise AssertionError("the engine tokenized a prompt the request preparation had tokenized")

    monkeypatch.setattr(llm.engine.tokenizer, "encode", refuse)
    resp = call.response(llm.driver.finals(llm.driver.add(call.items)))
    assert resp.choices[0].text == "Once upon a time" + want  # echo keeps the prompt as sent


def _greedy(n: int):
    from pagedllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0)


# Who may call a template: the one function (tokenizer/chat.py), the tokenizer's own method and
# its load-time check, the HF processor wrapper, and the benchmark's transformers reference.
_TEMPLATE_CALLERS = {"tokenizer/chat.py", "tokenizer/template_guard.py", "multimodal/processor.py", "bench/vision.py"}


def test_chat_templates_are_applied_in_one_place():
    callers = set()
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "apply_chat_template"
            ):
                callers.add(path.relative_to(ROOT).as_posix())
    assert callers <= _TEMPLATE_CALLERS, sorted(callers - _TEMPLATE_CALLERS)


def test_byte_table_is_gpt2s():
    try:
        from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
    except ImportError:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    from pagedllm.tokenizer.byte_level import bytes_to_unicode as ours

    assert ours() == bytes_to_unicode()


def test_token_text_bytes_spell_the_decoded_text(llm):
    tt = TokenText(llm.tokenizer)
    ids = llm.tokenizer.encode("naïve café ✓ 日本")
    assert b"".join(tt.bytes(t) for t in ids).decode("utf-8") == llm.tokenizer.decode(ids)
