"""Streamed answers: the streaming response that stops when its client goes away, and the
stream of one submission in any dialect, written through the dialect's framing."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..protocols.common.call import Framing
from .async_engine import EngineError, Submission


class StreamResponse(StreamingResponse):
    """A stream (server-sent events, or NDJSON lines) that stops, cancelling the generator, as
    soon as the client goes away, even while no token is being sent, so queued requests are
    aborted too."""

    def __init__(
        self, content: AsyncIterator[str], on_close: Callable[[], None], media_type: str = "text/event-stream"
    ) -> None:
        super().__init__(
            content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, media_type=media_type
        )
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


# While a request waits for its first token (a long prefill), the stream says it is alive this
# often: clients end a stream that is idle too long (qwen-code after 240 s).
KEEPALIVE_S = 10.0


async def framed(sub: Submission, framing: Framing, keepalive_s: float = KEEPALIVE_S) -> AsyncIterator[str]:
    """Any dialect's stream of one submission: the framing's start, its events for each engine
    output (the outputs queued together go out as one write), its end; its keep-alive while no
    output comes for `keepalive_s`; an engine failure ends it with the framing's error lines."""
    batches = sub.batches().__aiter__()
    pending: asyncio.Future | None = None
    try:
        for line in framing.start():
            yield line
        while True:
            pending = asyncio.ensure_future(batches.__anext__())
            while not (await asyncio.wait({pending}, timeout=keepalive_s))[0]:
                for line in framing.keepalive():
                    yield line
            try:
                outs = pending.result()
            except StopAsyncIteration:
                break
            text = "".join(line for out in outs for line in framing.events(out))
            if text:
                yield text
        for line in framing.end(sub.final_outputs()):
            yield line
    except EngineError as e:
        for line in framing.error(e):
            yield line
    finally:
        # Runs on normal end, on error and on cancellation (client gone): abort what is left.
        if pending is not None and not pending.done():
            pending.cancel()
        sub.abort_unfinished()
