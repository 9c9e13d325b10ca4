"""Reasoning output (issue 66.4): a Qwen3-architecture model whose greedy answer is forced through
`<think>...</think>` gives reasoning and content split exactly, by the markers its own chat
template holds: `reasoning_content` in OpenAI chat (streamed as its own deltas) through the
`openai` client, and a thinking block through the `anthropic` client.

The model is random-weight but crafted: attention and MLP outputs are zero, so each next token
depends on the current one only, and its embedding and lm_head rows make a chain
"\\n" -> <think> -> a -> b -> </think> -> c -> d -> <|im_end|>. transformers' greedy generation on
the same checkpoint is the reference for the tokens."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("httpx")

from pagedllm.protocols import reasoning  # noqa: E402
from test_server import serving  # noqa: E402

# The parts of Qwen3's chat template that matter here: past reasoning cut off at '</think>',
# reasoning_content written back between the markers, and enable_thinking.
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- set reasoning_content = message.reasoning_content or '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if reasoning_content %}{{- '<think>\\n' + reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, hf_smollm2_tokenizer):
    out = tmp_path_factory.mktemp("qwen3_thinker")
    tok = copy.deepcopy(hf_smollm2_tokenizer)  # the session's own stays as it is
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = QWEN3_TEMPLATE
    tok.eos_token = "<|im_end|>"
    think, end_think = tok.convert_tokens_to_ids(["<think>", "</think>"])
    nl = tok.encode("\n")[-1]
    words = [tok.encode(w, add_special_tokens=False) for w in ["Let", " me", "Sure", "!"]]
    assert all(len(w) == 1 for w in words), words
    a, b, c, d = (w[0] for w in words)
    chain = [nl, think, a, b, end_think, c, d, tok.eos_token_id]
    cfg = transformers.Qwen3Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for i, (cur, nxt) in enumerate(zip(chain, chain[1:])):
            e = torch.zeros(64)
            e[i] = 1.0
            model.model.embed_tokens.weight[cur] = e
            model.lm_head.weight[nxt, i] = 100.0
    model.save_pretrained(out)
    tok.save_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert ids == chain[1:], (ids, chain)  # the reference: transformers' greedy tokens
    reasoning_text = tok.decode([a, b])
    content_text = tok.decode([c, d])
    return out, reasoning_text, content_text


@pytest.fixture(scope="module")
def started(tmp_path_factory, thinker):
    yield from serving(
        tmp_path_factory,
        "reasoning",
        [
            str(thinker[0]),
            "--pa-gpu-mem",
            "64",
            "--max-model-len",
            "256",
            "--max-seqs",
            "4",
            "--served-model-name",
            "default",
        ],
    )


def test_markers_come_from_the_template():
    class T:
        chat_template = QWEN3_TEMPLATE

    assert reasoning.markers_of(T()) == reasoning.ReasoningMarkers("<think>", "</think>")
    T.chat_template = "{{ messages[0].content }}"
    assert reasoning.markers_of(T()) is None
    T.chat_template = "{% set r = content.split('</reflect>')[0] %}<reflect>{{ r }}"
    assert reasoning.markers_of(T()) == reasoning.ReasoningMarkers("<reflect>", "</reflect>")


def test_splitter_holds_back_partial_markers():
    m = reasoning.ReasoningMarkers("<think>", "</think>")
    s = reasoning.ReasoningSplitter(m)
    parts = [s.feed(x) for x in ["<th", "ink>", "a", "b</th", "ink>", "c"]] + [s.finish()]
    assert "".join(p[0] for p in parts) == "ab" and "".join(p[1] for p in parts) == "c"
    assert reasoning.split("no reasoning", m) == (None, "no reasoning")
    assert reasoning.split("ab</think>c", m, inside=True) == ("ab", "c")


ASK = [{"role": "user", "content": "Hi"}]


@pytest.mark.slow
def test_openai_reasoning_content(started, thinker):
    _, thought, answer = thinker
    server = started.get()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
    r = client.chat.completions.create(model="default", messages=ASK, temperature=0, max_tokens=12)
    msg = r.choices[0].message
    assert msg.content == answer and msg.model_extra["reasoning_content"] == thought
    assert r.choices[0].finish_reason == "stop"
    reasoning_parts, content_parts = [], []
    for chunk in client.chat.completions.create(
        model="default", messages=ASK, temperature=0, max_tokens=12, stream=True
    ):
        for ch in chunk.choices:
            extra = ch.delta.model_extra or {}
            assert not (extra.get("reasoning_content") and ch.delta.content)  # their own deltas
            reasoning_parts.append(extra.get("reasoning_content") or "")
            content_parts.append(ch.delta.content or "")
    assert "".join(reasoning_parts) == thought and "".join(content_parts) == answer
    # enable_thinking=false reaches the template: the prompt holds the closed empty block
    off = client.chat.completions.create(
        model="default",
        messages=ASK,
        temperature=0,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.usage.prompt_tokens > r.usage.prompt_tokens


def test_anthropic_thinking_block(started, thinker):
    _, thought, answer = thinker
    server = started.get()
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    greedy = {"extra_body": {"temperature": 0}}
    msg = client.messages.create(model="default", max_tokens=12, messages=ASK, **greedy)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == thought and msg.content[0].signature
    assert msg.content[1].text == answer and msg.stop_reason == "end_turn"
    with client.messages.stream(model="default", max_tokens=12, messages=ASK, **greedy) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in final.content] == [
        ("thinking", thought, None),
        ("text", None, answer),
    ]
    assert final.content[0].signature == msg.content[0].signature
    # the thinking block goes back in the next turn; thinking disabled reaches the template
    on = client.messages.count_tokens(model="default", messages=ASK)
    off = client.messages.count_tokens(model="default", messages=ASK, thinking={"type": "disabled"})
    assert off.input_tokens > on.input_tokens
    follow = client.messages.count_tokens(
        model="default",
        messages=[*ASK, {"role": "assistant", "content": msg.content}, {"role": "user", "content": "And?"}],
    )
    assert follow.input_tokens > on.input_tokens


def test_continuous_usage_stats(started):
    # (issue 66.5; on this server because its model answers fast and always alike)
    server = started.get()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=ASK,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert all(c.usage is not None for c in chunks[1:])
    done = [c.usage.completion_tokens for c in chunks[1:]]
    assert done == sorted(done) and done[-1] == 7  # the chain's seven tokens, <|im_end|> included
    assert {c.usage.prompt_tokens for c in chunks[1:]} == {chunks[-1].usage.prompt_tokens}
    plain = list(
        client.chat.completions.create(
            model="default",
            messages=ASK,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 7
    # text completions too
    text = list(
        client.completions.create(
            model="default",
            prompt="Let",
            temperature=0,
            max_tokens=5,
            stream=True,  # "Let" leads the chain
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert len(text) > 2 and all(c.usage is not None for c in text)
    done = [c.usage.completion_tokens for c in text]
    assert done == sorted(done) and done[0] >= 1 and done[-2] == done[-1] == text[-1].usage.completion_tokens
    assert not text[-1].choices  # the closing usage chunk


def test_ollama_thinking(started, thinker):
    """Ollama's messages carry `thinking` (streamed too), /api/generate's answer as well, and
    `think: false` reaches the template as enable_thinking (issue 66.4)."""
    ollama = pytest.importorskip("ollama")
    _, thought, answer = thinker
    server = started.get()
    client = ollama.Client(host=server.url, timeout=300)
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
    opts = {"temperature": 0, "num_predict": 12}
    r = client.chat(model="default", messages=ASK, options=opts, stream=False)
    assert r.message.thinking == thought and r.message.content == answer
    assert r.done and r.done_reason == "stop" and r.eval_count == 7
    parts = list(client.chat(model="default", messages=ASK, options=opts, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == thought
    assert "".join(p.message.content for p in parts) == answer
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert any(p.message.thinking for p in parts[:-1])  # thinking streams as it comes, not at the end
    g = client.generate(model="default", prompt="Hi", options=opts, stream=False)
    assert g.thinking == thought and g.response == answer
    streamed = list(client.generate(model="default", prompt="Hi", options=opts, stream=True))
    assert "".join(p.thinking or "" for p in streamed) == thought
    assert "".join(p.response for p in streamed) == answer
    # think=false reaches the template: the prompt holds the closed empty block, as OpenAI's
    # chat_template_kwargs put it there
    off = client.chat(model="default", messages=ASK, options={**opts, "num_predict": 1}, think=False)
    ref = oai.chat.completions.create(
        model="default",
        messages=ASK,
        temperature=0,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.prompt_eval_count == ref.usage.prompt_tokens > r.prompt_eval_count
    on = client.chat(model="default", messages=ASK, options=opts, think=True)
    assert on.prompt_eval_count == r.prompt_eval_count and on.message.thinking == thought
    # a past turn's thinking goes back through the template, as the template itself puts back
    # reasoning it cuts off an OpenAI message's content
    past = [*ASK, {"role": "assistant", "content": answer, "thinking": thought}, {"role": "user", "content": "And?"}]
    follow = client.chat(model="default", messages=past, options={**opts, "num_predict": 1})
    oai_past = [
        *ASK,
        {"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{answer}"},
        {"role": "user", "content": "And?"},
    ]
    ref = oai.chat.completions.create(model="default", messages=oai_past, temperature=0, max_tokens=1)
    bare = client.chat(
        model="default",
        messages=[*ASK, {"role": "assistant", "content": answer}, {"role": "user", "content": "And?"}],
        options={**opts, "num_predict": 1},
    )
    assert follow.prompt_eval_count == ref.usage.prompt_tokens > bare.prompt_eval_count
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="default", messages=ASK, think="very")
    assert e.value.status_code == 400 and "think" in e.value.error
