"""Generation on the engine thread for the routes: a call's grammar checked off the engine
thread, its requests submitted (aborted if the client leaves first), then streamed or
collected; and the two OpenAI generation routes, /v1/chat/completions and /v1/completions."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pydantic import BaseModel

from ..protocols.common.call import Call
from ..protocols.common.context import ServingContext
from ..protocols.common.errors import ApiError
from ..protocols.common.tokens import TokenText
from ..protocols.openai.calls import chat_call, completion_call
from ..protocols.openai.models import ChatCompletionRequest, CompletionRequest
from ..structured import limits as grammar_limits
from . import limits
from .async_engine import AsyncEngine, EngineError, ShuttingDown, Submission
from .bodies import read_body
from .sse import StreamResponse, framed

logger = logging.getLogger(__name__)


class Generation:
    """Runs prepared calls (pagedllm/protocols/common/call.py) on the engine for any route."""

    def __init__(
        self, llm: Any, engine: AsyncEngine, trimmer: limits.IdleTrimmer, work: limits.WorkPool, adapters: Any
    ) -> None:
        self.llm, self.engine, self.trimmer, self.work, self.adapters = llm, engine, trimmer, work, adapters

    async def submit(self, items: list, request: Request, grammar_param: str = "response_format") -> Submission:
        # A client gone before its requests are accepted aborts them in the same command batch:
        # they never reach the scheduler, so they cost no step. A few loop turns first let the
        # loop read an EOF that came while the request was being prepared (the selector's read
        # callback runs after this task's wake-up, and connection_lost one turn later): an idle
        # engine accepts an add at once, before a watcher started with it could post the abort.
        for _ in range(3):
            await asyncio.sleep(0)
        if await request.is_disconnected():
            raise ApiError("the client closed the request", status=499)
        return await unless_gone(self._submit(items, grammar_param), request)

    async def _submit(self, items: list, grammar_param: str) -> Submission:
        # A grammar is checked (and llguidance's token trie built, once) off the engine thread.
        self.trimmer.note_work()
        specs = {id(it.params.structured): it.params.structured for it in items if it.params.structured is not None}
        for spec in specs.values():
            try:
                await self.work.run(self.llm.engine.structured.prepare, spec, timeout=grammar_limits.COMPILE_TIMEOUT_S)
            except ValueError as e:
                raise ApiError(str(e), param=grammar_param) from None
            except asyncio.TimeoutError:
                raise ApiError(
                    f"the grammar did not compile within {grammar_limits.COMPILE_TIMEOUT_S:.0f} s; simplify it",
                    param=grammar_param,
                ) from None
        try:
            return await self.engine.submit(items)
        except ValueError as e:
            msg = str(e)
            code = "context_length_exceeded" if "max_model_len" in msg else None
            raise ApiError(msg, code=code) from None
        except EngineError as e:
            raise ApiError(str(e), status=503, type="server_error") from None

    def with_adapter(self, call: Call, model: str | None) -> Call:
        """The call's requests run with the adapter its `model` names (none for the base)."""
        req = self.adapters.get(model)
        if req is not None:
            call.items = [it._replace(lora=req) for it in call.items]
        return call

    async def answer(self, call: Call, request: Request) -> Response:
        """Run a call of any dialect on the engine: its stream, as the call's framing writes it,
        or its whole answer (499 when the client left first)."""
        sub = await self.submit(call.items, request, call.grammar_param)
        if call.stream:
            return StreamResponse(framed(sub, call.framing), sub.abort_unfinished, call.framing.media_type)
        finals = await collect_or_fail(sub, request)
        if finals is None:
            return Response(status_code=499)
        answer = call.response(finals)
        return JSONResponse(answer.model_dump(exclude_none=False) if isinstance(answer, BaseModel) else answer)


def install(
    app: FastAPI,
    gen: Generation,
    ctx: ServingContext,
    token_text: TokenText,
    check_model: Callable[[str | None], None],
    max_body_bytes: int,
) -> None:
    """POST /v1/chat/completions and /v1/completions: OpenAI's translation, run by `gen`."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = await read_body(request, ChatCompletionRequest, max_body_bytes)
        check_model(req.model)
        limits.check_prompt_chars(limits.chat_chars(req), ctx.max_model_len, "messages")
        call = await gen.work.run(chat_call, req, ctx, token_text)
        return await gen.answer(gen.with_adapter(call, req.model), request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await read_body(request, CompletionRequest, max_body_bytes)
        check_model(req.model)
        for p in [req.prompt] if isinstance(req.prompt, str) else req.prompt or []:
            if isinstance(p, str):
                limits.check_prompt_chars(len(p), ctx.max_model_len, "prompt")
        call = await gen.work.run(completion_call, req, ctx, token_text)
        return await gen.answer(gen.with_adapter(call, req.model), request)


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_gone(work: Any, request: Request) -> Any:
    """Await `work`, unless the client disconnects first: then cancel it (a cancelled
    `AsyncEngine.submit` aborts what it added) and answer 499."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself was cancelled (shutdown)
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ApiError("the client closed the request", status=499)
    return task.result()


async def collect(sub: Submission, request: Request) -> list | None:
    """Wait for every request of `sub` to finish; None if the client left first (then abort)."""

    async def consume() -> None:
        async for _ in sub:
            pass

    work = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            work.result()  # re-raises an EngineError
            return sub.final_outputs()
        logger.info("client went away; aborting %s", ", ".join(sub.request_ids))
        return None
    finally:
        work.cancel()
        watcher.cancel()
        sub.abort_unfinished()


async def collect_or_fail(sub: Submission, request: Request) -> list | None:
    """`collect`, with an engine failure as OpenAI's server error (503 while shutting down)."""
    try:
        return await collect(sub, request)
    except EngineError as e:
        status = 503 if isinstance(e, ShuttingDown) else 500
        raise ApiError(str(e), status=status, type="server_error") from None
