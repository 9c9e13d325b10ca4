"""The one refusal every dialect raises; each face renders it in its own error shape."""

from __future__ import annotations


class ApiError(Exception):
    """A request the server refuses; rendered as OpenAI's error body by the HTTP face."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
