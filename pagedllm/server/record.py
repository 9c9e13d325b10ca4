"""`pagedllm serve --record-requests DIR`: each request an agent (or any client) makes is kept
as one JSON file, so the session can be replayed later against any server
(`pagedllm bench agent`) or in tests. Plain ASGI, so streams and disconnects pass through
untouched; credentials are never written."""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from starlette.types import Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

# What a replay needs to be answered as the original was (the dialect, its beta features, the
# client's name); never Authorization or x-api-key.
KEPT_HEADERS = ("anthropic-version", "anthropic-beta", "content-type", "accept", "user-agent", "originator")


class RequestRecorder:
    """Writes DIR/NNNNN.json for every request with a body: method, path, kept headers, the
    JSON body, when it came (seconds after the first) and the status it got."""

    def __init__(self, app: Any, folder: str | Path) -> None:
        self.app = app
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        start = max((int(p.stem) for p in self.folder.glob("[0-9]*.json") if p.stem.isdigit()), default=0)
        self.numbers = itertools.count(start + 1)
        self.lock = threading.Lock()
        self.t0: float | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT"):
            await self.app(scope, receive, send)
            return
        arrived = time.time()
        if self.t0 is None:
            self.t0 = arrived
        chunks: list[bytes] = []
        status: list[int] = []

        async def receive_body() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive_body, send_status)
        finally:
            self._write(scope, b"".join(chunks), status[0] if status else None, arrived)

    def _write(self, scope: Scope, body: bytes, status: int | None, arrived: float) -> None:
        try:
            parsed: Any = json.loads(body) if body else None
        except ValueError:
            parsed = body.decode("utf-8", "replace")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        path = scope.get("path", "") + (f"?{scope['query_string'].decode()}" if scope.get("query_string") else "")
        record = {
            "at_s": round(arrived - (self.t0 or arrived), 3),
            "took_s": round(time.time() - arrived, 3),
            "method": scope.get("method"),
            "path": path,
            "status": status,
            "headers": {k: headers[k] for k in KEPT_HEADERS if k in headers},
            "body": parsed,
        }
        with self.lock:
            target = self.folder / f"{next(self.numbers):05d}.json"
        tmp = target.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(record, ensure_ascii=False, indent=1), encoding="utf-8")
            os.replace(tmp, target)
        except OSError as e:  # a full disk must not fail the request that was served
            logger.warning("could not record a request into %s: %s", self.folder, e)
