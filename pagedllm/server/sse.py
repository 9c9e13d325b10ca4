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


async def stream_events(sub: Submission, start: list, events: Callable, usage: Callable | None,
                  include_usage: bool) -> AsyncIterator[str]:
    """The stream's server-sent events: `events(output, include_usage)` renders one output's;
    the outputs queued together go out as one write."""
    try:
        for c in start:
            yield sse_line(c, include_usage)
        async for outs in sub.batches():
            text = "".join(line for out in outs for line in events(out, include_usage))
            if text:
                yield text
        if usage is not None:
            yield sse_line(usage(sub.final_outputs()), True)
        yield "data: [DONE]\n\n"
    except EngineError as e:
        yield sse_error(e)
        yield "data: [DONE]\n\n"
    finally:
        # Runs on normal end, on error and on cancellation (client gone): abort what is left.
        sub.abort_unfinished()
