"""Errors in OpenAI's body: the error response, and the handlers that turn every failure
(a refused request, a validation error, an unexpected one) into it, never a stack trace."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..protocols.common.errors import ApiError
from ..protocols.openai.models import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_STATUS_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def error_response(
    status: int,
    message: str,
    type: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    if type is None:
        type = _STATUS_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def validation_message(err: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    errors = err.errors()
    parts, first_param = [], None
    for e in errors[:3]:
        # Union members add their type name ('str', 'list[int]', 'function-plain[...]') to the
        # path; it only confuses the client.
        loc = [str(x) for x in e.get("loc", ()) if not _is_type_tag(x)]
        param = ".".join(loc) or None
        first_param = first_param or param
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{param}: {msg}" if param else msg)
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "invalid request: " + "; ".join(parts) + more, first_param


def _is_type_tag(part: Any) -> bool:
    if not isinstance(part, str):
        return False
    return part in _TYPE_TAGS or "[" in part or part.startswith("function-")


_TYPE_TAGS = {"body", "str", "int", "float", "bool", "dict", "list", "none"}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = exc.detail if isinstance(exc.detail, str) else "request failed"
        return error_response(exc.status_code, msg, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = validation_message(exc)
        return error_response(400, msg, param=param)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")  # the trace goes to the log, never to the client
        return error_response(500, "internal server error", "server_error")
