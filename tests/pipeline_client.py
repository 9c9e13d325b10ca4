"""The openai client inside node 0's namespace (tests/test_multinode.py): chat, streamed and
not, and a forced tool call, from a `pagedllm serve -pp 2` whose stages sit in two namespaces;
then a long streamed request, during which the test kills the second node. Writes what it saw
(answers, the in-flight request's error and when it came, the next request's status) as JSON."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_unit",
            "description": "Set the temperature unit.",
            "parameters": {
                "type": "object",
                "properties": {"unit": {"type": "string", "enum": ["C", "F"]}},
                "required": ["unit"],
                "additionalProperties": False,
            },
        },
    }
]


def main() -> int:
    url, out, inflight = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    result: dict = {}
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            result["error"] = "the server was not ready in 300 s"
            out.write_text(json.dumps(result))
            return 1
        time.sleep(0.5)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Name three colours."}]
    kw = dict(model="tiny", messages=msgs, max_tokens=16, temperature=0.0)
    result["whole"] = client.chat.completions.create(**kw).choices[0].message.content
    result["streamed"] = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True) if c.choices
    )
    ch = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Use Celsius."}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "set_unit"}},
        temperature=0.0,
        max_tokens=40,
    ).choices[0]
    result["tool_calls"] = [
        {"name": c.function.name, "arguments": c.function.arguments} for c in ch.message.tool_calls or []
    ]
    result["finish_reason"] = ch.finish_reason
    out.write_text(json.dumps(result))
    # A request far longer than the test waits: it is in flight when the second node dies.
    stream = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=960, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
    )
    try:
        for i, c in enumerate(stream):
            if i == 5:
                inflight.write_text("")
        result["inflight_error"] = "none: the stream ended without an error"
    except Exception as e:
        result["inflight_error"] = f"{type(e).__name__}: {e}"
    result["inflight_failed_at"] = time.time()
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", json=kw, timeout=60)
    result["after"] = {"status": r.status_code, "body": r.text[:500], "seconds": time.monotonic() - t0}
    result["health"] = httpx.get(f"{url}/health", timeout=10).status_code
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
