"""Anthropic's Messages routes: POST /v1/messages (streamed and not) and
/v1/messages/count_tokens, over pagedllm/protocols/anthropic/messages.py, run by the same
`Generation` as OpenAI's chat. Every refusal on them is in Anthropic's error shape."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..protocols.anthropic import messages as dialect
from ..protocols.common.errors import ApiError
from . import limits
from .generation import Generation
from .routes import Served, document_bodies

logger = logging.getLogger(__name__)


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(dialect.error_body(status, message), status_code=status)


def anthropic_errors(route: Callable) -> Callable:
    """A route's refusals (and unexpected failures) as Anthropic's error body."""

    @functools.wraps(route)
    async def wrapped(request: Request) -> Response:
        try:
            return await route(request)
        except ApiError as e:
            return error_response(e.status, e.message)
        except Exception:  # the trace goes to the log, never to the client
            logger.exception("unhandled error")
            return error_response(500, "internal server error")

    return wrapped


def _chars(req: Any) -> int:
    n = len(req.system) if isinstance(req.system, str) else len(str(req.system or ""))
    return n + sum(len(m.content) if isinstance(m.content, str) else len(str(m.content)) for m in req.messages)


def install(app: FastAPI, s: Served, gen: Generation, keep_attribution: bool) -> None:
    async def read(request: Request, model: type) -> Any:
        req = await s.read_request(request, model)
        limits.check_prompt_chars(_chars(req), s.ctx.max_model_len, "messages")
        return req

    @app.post("/v1/messages")
    @anthropic_errors
    async def create_message(request: Request) -> Response:
        req: dialect.MessagesRequest = await read(request, dialect.MessagesRequest)
        return await gen.answer(await s.run(dialect.messages_call, req, s.ctx, keep_attribution), request)

    @app.post("/v1/messages/count_tokens")
    @anthropic_errors
    async def count_tokens(request: Request) -> Response:
        req: dialect.CountTokensRequest = await read(request, dialect.CountTokensRequest)
        return JSONResponse(await s.run(dialect.count_tokens, req, s.ctx, keep_attribution))

    document_bodies(
        app, {"/v1/messages": dialect.MessagesRequest, "/v1/messages/count_tokens": dialect.CountTokensRequest}
    )
