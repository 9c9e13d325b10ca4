"""The mistral.rs-style Python API: Runner, Which, ChatCompletionRequest, Architecture, PagedCacheType."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedllm import Architecture, ChatCompletionRequest, PagedCacheType, Runner, Which
from pagedllm.api import CompletionRequest
from test_server import check_usage_rates

# mistral.rs's PagedAttention docs example, with only the import and the model id changed.
DOCS_EXAMPLE = """
from pagedllm import Runner, Which, ChatCompletionRequest, Architecture, PagedCacheType

runner = Runner(
    which=Which.Plain(
        model_id="default",
        arch=Architecture.Mistral,
    ),
    pa_gpu_mem = 4096,
    pa_blk_size = 32,
    pa_cache_type = PagedCacheType.F8E4M3,
)

res = runner.send_chat_completion_request(
    ChatCompletionRequest(
        model="mistral",
        messages=[
            {"role": "user", "content": "Tell me a story about the Rust type system."}
        ],
        max_tokens=256,
        presence_penalty=1.0,
        top_p=0.1,
        temperature=0.1,
    )
)
print(res.choices[0].message.content)
print(res.usage)
"""

# (Asked bare, SmolLM2's first token is a near tie between "The" and "L" that the CPU's bf16
# GEMM decides: AMX's picked "L'Étoile". Asked this way every path answers "The capital of
# France is Paris.", its first token 1.95 of a logprob clear.)
QUESTION = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
]


@pytest.fixture(scope="module")
def runner(smollm2_gguf_path):
    return Runner(
        which=Which.GGUF(
            tok_model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            quantized_model_id=str(smollm2_gguf_path.parent),
            quantized_filename=smollm2_gguf_path.name,
        ),
        pa_gpu_mem=128,
        pa_blk_size=32,
        pa_cache_type=PagedCacheType.Auto,
    )


@pytest.mark.slow
def test_docs_example_runs(smollm2_gguf_path, hf_smollm2_tokenizer):
    from pagedllm import LLM, SamplingParams

    code = DOCS_EXAMPLE
    mem, max_tokens = 4096, 256
    if os.environ.get("PAGEDLLM_FULL_EXAMPLE") != "1":
        # As written it zero-fills 4 GB of KV cache and generates 256 tokens on the CPU (minutes);
        # PAGEDLLM_FULL_EXAMPLE=1 runs it verbatim.
        mem, max_tokens = 256, 16
        code = code.replace("pa_gpu_mem = 4096", "pa_gpu_mem = 256").replace("max_tokens=256", "max_tokens=16")
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert r.returncode == 0, r.stderr
    printed, usage = r.stdout.removesuffix("\n").rsplit("\n", 1)
    assert "avg_prompt_tok_per_sec=" in usage and "avg_compl_tok_per_sec=" in usage
    # The same request in this process, through LLM.chat: the example printed exactly its answer,
    # and that answer is what transformers' tokenizer makes of the generated tokens.
    llm = LLM("default", kv_cache_memory_mb=mem, block_size=32, kv_cache_dtype="f8e4m3")
    out = llm.chat(
        [{"role": "user", "content": "Tell me a story about the Rust type system."}],
        SamplingParams(max_tokens=max_tokens, presence_penalty=1.0, top_p=0.1, temperature=0.1),
        use_tqdm=False,
    )
    assert printed == out.text
    assert out.text == hf_smollm2_tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert f"completion_tokens={len(out.token_ids)}" in usage


def test_chat_completion(runner):
    res = runner.send_chat_completion_request(
        ChatCompletionRequest(model="default", messages=QUESTION, max_tokens=12, temperature=0.0)
    )
    assert "Paris" in res.choices[0].message.content
    assert res.choices[0].finish_reason in ("stop", "length")
    u = res.usage
    assert u.prompt_tokens > 5 and u.completion_tokens >= 1
    check_usage_rates(u.prompt_tokens, u.completion_tokens, u.model_dump())


def test_stream_gives_chunks_equal_to_the_answer(runner):
    kw = dict(model="default", messages=QUESTION, max_tokens=10, temperature=0.8, seed=42, top_p=0.9)
    whole = runner.send_chat_completion_request(ChatCompletionRequest(**kw))
    chunks = list(
        runner.send_chat_completion_request(
            ChatCompletionRequest(stream=True, stream_options={"include_usage": True}, **kw)
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_closing_a_stream_aborts_the_request(runner):
    stream = runner.send_chat_completion_request(
        ChatCompletionRequest(model="default", messages=QUESTION, max_tokens=200, ignore_eos=True, stream=True)
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    eng = runner.engine
    assert not eng.has_unfinished() and eng.block_manager.num_used_blocks == 0


def test_mistralrs_field_names_and_dict_requests(runner):
    free = (
        runner.send_chat_completion_request(
            ChatCompletionRequest(model="default", messages=QUESTION, max_tokens=12, temperature=0.0)
        )
        .choices[0]
        .message.content
    )
    assert "Paris" in free  # without the stop string the answer names it
    res = runner.send_chat_completion_request(
        ChatCompletionRequest(
            model="default", messages=QUESTION, n_choices=2, stop_seqs=["Paris"], max_tokens=12, temperature=0.0
        )
    )
    assert len(res.choices) == 2
    for c in res.choices:  # greedy: both choices are the answer cut just before the stop string
        assert c.finish_reason == "stop"
        assert c.message.content == free[: free.index("Paris")]
    res = runner.send_chat_completion_request({"messages": QUESTION, "max_tokens": 2, "temperature": 0.0})
    assert res.usage.completion_tokens == 2 and res.choices[0].finish_reason == "length"


def test_completion_request(runner, hf_smollm2_tokenizer):
    from pagedllm import SamplingParams

    prompt = "The capital of France is"
    res = runner.send_completion_request(
        CompletionRequest(model="default", prompt=prompt, max_tokens=4, temperature=0.0, echo=True)
    )
    # The same prompt through the LLM API: echo is the prompt, then exactly the generated text,
    # which is what transformers' tokenizer makes of the generated tokens.
    want = runner.llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    assert want.text == hf_smollm2_tokenizer.decode(want.token_ids, skip_special_tokens=True)
    assert res.choices[0].text == prompt + want.text
    assert res.choices[0].finish_reason == want.finish_reason == "length"
    assert res.usage.completion_tokens == len(want.token_ids) == 4
    assert res.usage.prompt_tokens == len(hf_smollm2_tokenizer(prompt)["input_ids"])


def test_bad_requests_raise_value_error(runner):
    with pytest.raises(ValueError):
        ChatCompletionRequest(model="default", messages=QUESTION, temperature=-1)
    with pytest.raises(ValueError, match="at most"):
        runner.send_chat_completion_request(ChatCompletionRequest(model="default", messages=QUESTION, n=500))
    with pytest.raises(ValueError, match="max_model_len"):
        runner.send_chat_completion_request(
            ChatCompletionRequest(model="default", messages=[{"role": "user", "content": "hi " * 9000}])
        )
    assert not runner.engine.has_unfinished()


def test_names_and_hints():
    assert Architecture.Mistral.value == "mistral" and PagedCacheType.F8E4M3.value == "f8e4m3"
    w = Which.Plain(model_id="default", arch=Architecture.Llama)
    assert w.model_id == "default"
    with pytest.raises(TypeError):
        Runner(which="default")


def test_completion_request_and_short_model_names(smollm2_gguf_path, tmp_path):
    import pagedllm
    from pagedllm.loading.source import resolve

    assert pagedllm.CompletionRequest is CompletionRequest  # as the README's Runner example implies
    assert resolve("default").short_name == "default"
    assert resolve(str(smollm2_gguf_path)).short_name == smollm2_gguf_path.stem
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve(str(folder)).short_name == "my-model"
    assert resolve(f"{folder}/").short_name == "my-model"


def test_an_arch_hint_naming_the_checkpoints_family_is_no_mismatch(caplog):
    # mistral.rs's --arch names a family; the checkpoint says its architecture class. The
    # warning is for a hint that names another family, not for every family outside Llama,
    # Mistral and Qwen2.
    import logging

    from pagedllm.llm import check_arch

    with caplog.at_level(logging.WARNING, logger="pagedllm.llm"):
        for arch, actual in [
            ("qwen3", "Qwen3ForCausalLM"),
            ("gemma2", "Gemma2ForCausalLM"),
            ("phi3", "Phi3ForCausalLM"),
            ("mixtral", "MixtralForCausalLM"),
            ("qwen2_moe", "Qwen2MoeForCausalLM"),
            ("Llama", "LlamaForCausalLM"),
        ]:
            check_arch(arch, actual)
        assert not caplog.records
        check_arch("mistral", "LlamaForCausalLM")
    assert "arch mistral was given but the checkpoint is LlamaForCausalLM" in caplog.text
