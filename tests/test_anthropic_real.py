"""Issue 66 acceptance 1 by hand: the `anthropic` SDK against `pagedllm serve` on the real
Qwen2.5-Coder-0.5B GGUF (skipped where the file is absent). Run:
    pytest -q -s tests/test_anthropic_real.py -n 0"""

from __future__ import annotations

from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from test_server import API_KEY, serving  # noqa: E402

GGUF = Path.home() / ".cache/pagedllm/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not GGUF.is_file(), reason=f"{GGUF} is not here")]
GREEDY = {"extra_body": {"temperature": 0}}
TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
ASK = [{"role": "user", "content": "Write one short sentence about the sea."}]


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    yield from serving(
        tmp_path_factory,
        "anthropic_real",
        [
            str(GGUF),
            "--api-key",
            API_KEY,
            "--served-model-name",
            "qwen",
            "--max-model-len",
            "2048",
            "--max-seqs",
            "4",
            "--log-level",
            "info",
        ],
    )


def test_real_file(started):
    server = started.get()
    client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=600)
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=600)
    msg = client.messages.create(model="qwen", max_tokens=40, messages=ASK, **GREEDY)
    print("\nmessage:", msg.content[0].text, msg.stop_reason, msg.usage)
    events = []
    with client.messages.stream(model="qwen", max_tokens=40, messages=ASK, **GREEDY) as stream:
        for ev in stream:
            events.append(ev.type)
        final = stream.get_final_message()
    print("stream events:", [e for e in events if e not in ("text",)][:4], "...", events[-3:])
    assert final.content[0].text == msg.content[0].text and final.stop_reason == msg.stop_reason
    chat = oai.chat.completions.create(model="qwen", max_tokens=40, temperature=0, messages=ASK)
    print("chat/completions:", chat.choices[0].message.content)
    assert chat.choices[0].message.content == msg.content[0].text
    count = client.messages.count_tokens(model="qwen", messages=ASK)
    print("count_tokens:", count.input_tokens, "served:", msg.usage.input_tokens + msg.usage.cache_read_input_tokens)
    assert count.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        use = client.messages.create(
            model="qwen", max_tokens=60, messages=ask, tools=TOOLS, tool_choice=choice, **GREEDY
        )
        call = [b for b in use.content if b.type == "tool_use"][0]
        print("tool_use", choice, call.name, call.input, use.stop_reason)
        assert use.stop_reason == "tool_use" and call.name == "get_weather" and "city" in call.input
        answer = client.messages.create(
            model="qwen",
            max_tokens=60,
            tools=TOOLS,
            **GREEDY,
            messages=[
                *ask,
                {"role": "assistant", "content": use.content},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C"}],
                },
            ],
        )
        print("answer:", answer.content[0].text if answer.content else answer.content, answer.stop_reason)
        assert answer.content and answer.content[0].type == "text"
    # The 0.5B, given only the result, writes the call again (transformers' greedy tokens on the
    # same file and the same template text do too); a user turn that asks for the answer beside
    # the result gets one that uses it.
    answer = client.messages.create(
        model="qwen",
        max_tokens=60,
        tools=TOOLS,
        **GREEDY,
        messages=[
            *ask,
            {"role": "assistant", "content": use.content},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C"},
                    {"type": "text", "text": "Using that result, answer my question in one sentence."},
                ],
            },
        ],
    )
    print("answer using the result:", answer.content[0].text, answer.stop_reason)
    assert answer.stop_reason == "end_turn" and "24" in answer.content[0].text
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=API_KEY, max_retries=0, timeout=600)
    assert bearer.messages.create(model="qwen", max_tokens=2, messages=ASK).content
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="qwen", max_tokens=2, messages=ASK
        )
    print("wrong key:", e.value.status_code, e.value.body)
