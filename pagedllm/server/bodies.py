"""Request bodies: read within the size limit (parsed off the event loop), validated into a
request model with OpenAI's error for a bad field."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from ..protocols.common.errors import ApiError
from . import limits
from .errors import validation_message


async def read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            too_big = int(declared) > limit
        except ValueError:
            raise ApiError("invalid Content-Length header") from None
        if too_big:
            raise ApiError(f"request body is larger than the {limit} byte limit", status=413)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(f"request body is larger than the {limit} byte limit", status=413)
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body was read: nothing to answer, nothing to log
        raise ApiError("the client closed the request", status=499) from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise ApiError("request body is empty; send a JSON object")
    body = await limits.load_json_off_loop(raw)
    if not isinstance(body, dict):
        raise ApiError(f"request body must be a JSON object, not {type(body).__name__}")
    return body


def parse(model: type[BaseModel], body: dict) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        msg, param = validation_message(e)
        raise ApiError(msg, param=param) from None


async def read_body(request: Request, model: type[BaseModel], limit: int) -> Any:
    return parse(model, await read_json(request, limit))
