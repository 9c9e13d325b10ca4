"""Server-sent events: the streaming response that stops when its client goes away, and the
OpenAI-style event stream of one submission (chunks, usage, an error event, [DONE])."""
from __future__ import annotations

from typing import AsyncIterator, Callable

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..protocols.openai.models import ErrorInfo, ErrorResponse
from ..protocols.openai.stream import sse_line
from .async_engine import EngineError, Submission


class SSEResponse(StreamingResponse):
    """Server-sent events that stop (cancelling the generator) as soon as the client goes away,
    even while no token is being sent, so queued requests are aborted too."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the connection broke while sending
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            # Also covers a client gone before the first event, when the generator never ran.
            self.on_close()


def sse_error(exc: Exception) -> str:
    body = ErrorResponse(error=ErrorInfo(message=str(exc), type="server_error"))
    return f"data: {body.model_dump_json()}\n\n"


def stream_events(sub: Submission, start: list, events: Callable, usage: Callable | None,
                  include_usage: bool) -> AsyncIterator[str]:
    """OpenAI's event stream: `events(output, include_usage)` renders one output's; a usage
    chunk when asked for, and [DONE] after everything, an error too."""
    def tail() -> list[str]:
        return [sse_line(usage(sub.final_outputs()), True)] if usage is not None else []

    return stream_lines(sub, [sse_line(c, include_usage) for c in start],
                        lambda out: events(out, include_usage), tail,
                        lambda e: [sse_error(e)], "data: [DONE]\n\n")


async def stream_lines(sub: Submission, head: list[str], events: Callable, tail: Callable[[], list[str]],
                       on_error: Callable[[Exception], list[str]], end: str = "") -> AsyncIterator[str]:
    """Any dialect's event stream: `head`, then `events(output)` for each engine output (the
    outputs queued together go out as one write), then `tail()`; `on_error` renders an engine
    failure; `end` closes the stream either way."""
    try:
        for line in head:
            yield line
        async for outs in sub.batches():
            text = "".join(line for out in outs for line in events(out))
            if text:
                yield text
        for line in tail():
            yield line
        if end:
            yield end
    except EngineError as e:
        for line in on_error(e):
            yield line
        if end:
            yield end
    finally:
        # Runs on normal end, on error and on cancellation (client gone): abort what is left.
        sub.abort_unfinished()
