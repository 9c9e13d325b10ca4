"""A stream waiting for its first token (a coding agent's long first prompt prefilling) says it
is alive every few seconds, in its dialect's way, so a client's idle timeout does not end it:
qwen-code gives up on a stream without a chunk for 240 s, which a 17,500-token prompt on two
cores outlasts."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedllm.server.sse import framed

openai = pytest.importorskip("openai")


class SlowSubmission:
    """A submission whose one output comes after `delay` seconds."""

    def __init__(self, delay: float) -> None:
        self.delay, self.aborted = delay, False

    async def batches(self):
        await asyncio.sleep(self.delay)
        yield ["out"]

    def final_outputs(self) -> list:
        return []

    def abort_unfinished(self) -> None:
        self.aborted = True


class Lines:
    media_type = "text/plain"

    def start(self) -> list[str]:
        return ["start"]

    def events(self, out) -> list[str]:
        return [out]

    def end(self, finals) -> list[str]:
        return ["end"]

    def error(self, exc) -> list[str]:
        return ["error"]

    def keepalive(self) -> list[str]:
        return ["alive"]


async def _all(gen) -> list[str]:
    return [line async for line in gen]


def test_keepalive_while_no_output_comes():
    sub = SlowSubmission(0.55)
    lines = asyncio.run(_all(framed(sub, Lines(), keepalive_s=0.1)))
    assert lines[0] == "start" and lines[-2:] == ["out", "end"]
    assert 3 <= lines.count("alive") <= 6 and sub.aborted
    assert asyncio.run(_all(framed(SlowSubmission(0.0), Lines(), keepalive_s=0.1))) == ["start", "out", "end"]


def test_each_dialect_keepalive_is_nothing_its_clients_read_as_data():
    from pagedllm.protocols.anthropic.answer import MessageStreamer
    from pagedllm.protocols.openai.stream import ChatStreamer, CompletionStreamer, OpenAIFraming

    [chunk] = OpenAIFraming(ChatStreamer("chatcmpl-1", "m", 1)).keepalive()
    parsed = openai.types.chat.ChatCompletionChunk.model_validate(json.loads(chunk.removeprefix("data: ")))
    assert parsed.choices[0].delta.content is None and parsed.choices[0].finish_reason is None
    assert OpenAIFraming(CompletionStreamer("cmpl-1", "m", 1, {"cmpl-1": 0})).keepalive() == [": keep-alive\n\n"]
    [ping] = MessageStreamer("msg_1", "m", 3, None, None).keepalive()
    assert ping == 'event: ping\ndata: {"type": "ping"}\n\n'
