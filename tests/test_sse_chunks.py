"""A streamed plain-text delta is rendered from a template cut from the chunk model's own JSON:
it must be byte for byte what pydantic writes for the same chunk (the reference), whatever the
text holds, with and without stream_options.include_usage."""

from __future__ import annotations

import json

import pytest

from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.protocols.openai.stream import ChatStreamer, CompletionStreamer, sse_line

TEXTS = [
    "hello",
    "héllo ✓ 😀",
    ' "quoted" \\ back\nslash\t',
    "\x00\x1f\x7f",
    "\u2028\u2029 end",
    "</script>",
    "",
    "e\u0301",
]


def _out(text: str, finish: str | None = None, rid: str = "r") -> RequestOutput:
    c = CompletionOutput(0, "so far", [5], finish, None, None, text, [7])
    return RequestOutput(
        rid, None, [1, 2, 3], [c], finish is not None, RequestMetrics(arrival_time=0.0, num_prompt_tokens=3)
    )


def _no_created(line: str) -> str:
    assert line.startswith("data: ") and line.endswith("\n\n")
    body = json.loads(line[6:])
    assert isinstance(body.pop("created"), int)
    # the bytes around `created`, compared exactly
    head, _, rest = line.partition('"created":')
    return head + rest.partition(",")[2]


@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize(
    "make",
    [lambda: ChatStreamer("chatcmpl-x", "m", 1), lambda: CompletionStreamer("cmpl-x", "m", 1, {"r": 0})],
    ids=["chat", "completion"],
)
def test_text_deltas_match_pydantic_byte_for_byte(make, include_usage):
    fast, ref = make(), make()
    for text in [*TEXTS, "last"]:
        got = fast.events(_out(text), include_usage)
        want = [sse_line(c, include_usage) for c in ref.update(_out(text))]
        assert [_no_created(x) for x in got] == [_no_created(x) for x in want], text
    # the finish (its own chunk) still comes from the models
    got = fast.events(_out("!", "length"), include_usage)
    want = [sse_line(c, include_usage) for c in ref.update(_out("!", "length"))]
    assert [_no_created(x) for x in got] == [_no_created(x) for x in want]
    assert json.loads(got[-1][6:])["choices"][0]["finish_reason"] == "length"
    assert ("usage" in json.loads(got[0][6:])) is include_usage
