"""The OpenAI-compatible HTTP server: FastAPI routes over the threaded engine.

Every generation is an async stream from the engine thread. A client that goes
away (streaming or not) aborts its requests, which frees their KV blocks at the
next engine step. Errors always use OpenAI's error body; bad input gets a 4xx and
nothing ever returns a stack trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import time
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.types import Receive, Scope, Send

from .._version import __version__
from ..protocols.anthropic import messages as anthropic_dialect
from ..protocols.common.context import ServingContext
from ..protocols.common.errors import ApiError
from ..protocols.common.tokens import TokenText
from ..protocols.openai.models import ModelCard, ModelList
from . import anthropic, embeddings, generation, infill, limits, lora, ollama, responses, routes, worker
from .async_engine import AsyncEngine, ShuttingDown
from .errors import error_response, install_error_handlers
from .generation import Generation
from .metrics import CONTENT_TYPE, ServerMetrics
from .record import RequestRecorder

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
_CHAT_PAGE = Path(__file__).parent / "static" / "chat.html"  # the chat page at GET /


@dataclass
class ServerConfig:
    model_name: str | None = None  # the name responses carry (default: the model's short name)
    aliases: tuple[str, ...] = ()  # other names requests may use
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_n: int | None = None
    allowed_origins: tuple[str, ...] = ()  # CORS: origins browsers may call from ("*": any)
    shutdown_timeout: float = 0.0  # seconds SIGTERM/SIGINT waits for requests in flight
    responses_store_size: int = responses.DEFAULT_STORE_SIZE  # /v1/responses kept for previous_response_id
    header_timeout: float = limits.DEFAULT_HEADER_TIMEOUT_S  # seconds for a request's headers
    keep_alive_timeout: float = limits.DEFAULT_KEEP_ALIVE_S  # an idle connection is closed after
    max_connections: int | None = None  # connections and requests at once; past it a 503
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, adapter folder) served at start (--lora-modules)
    allow_runtime_lora: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    # /v1/messages: keep Claude Code's changing attribution line in the system prompt (by
    # default it is dropped, so it does not defeat prefix caching; protocols/anthropic/messages.py)
    keep_anthropic_attribution: bool = False
    root_path: str = ""  # the path prefix a proxy serves this server under (--root-path)
    tokenizer_path: str | None = None  # told to a router's /model_info: a tokenizer folder or hub id it can load
    record_requests: str | None = None  # a folder each request is written to (server/record.py)


def route_path(scope: Scope) -> str:
    """The path the routes match: behind --root-path, ASGI's `path` begins with the proxy's
    prefix (uvicorn puts it there, as the spec asks), which the router leaves out."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root + "/") else path


class AuthMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which would hide client disconnects from the routes).
    The key comes as 'Authorization: Bearer KEY' or, as Anthropic's clients send it,
    'x-api-key: KEY'. A CORS preflight carries no credentials (browsers never send them on
    one), so it passes to the CORS layer or the router."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.bearer = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_path(scope)
        if scope["type"] == "http" and path != "/health":
            headers = dict(scope.get("headers") or [])
            preflight = scope.get("method") == "OPTIONS" and b"access-control-request-method" in headers
            given = headers.get(b"authorization", b"")
            x_key = headers.get(b"x-api-key", b"")
            ok = hmac.compare_digest(given, self.bearer) or (bool(x_key) and hmac.compare_digest(x_key, self.key))
            if not ok and not preflight:
                msg = (
                    "missing API key: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY')"
                    if not given and not x_key
                    else "invalid API key"
                )
                if path.startswith("/v1/messages"):  # Anthropic's error shape
                    resp = anthropic.error_response(401, msg)
                else:
                    resp = error_response(401, msg, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ShutdownGate:
    """Plain ASGI. Once the server is stopping, a request still in its handler after a short
    grace (a client still sending its body, a stream that cannot be written) is cancelled here
    and answered with a 503 if nothing was sent yet. Left to uvicorn, its graceful-shutdown
    timeout would cancel it later and log the CancelledError's traceback."""

    GRACE_S = 0.5

    def __init__(self, app: Any) -> None:
        self.app = app
        self.tasks: set[asyncio.Task] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closing = False
        self.draining = False  # --shutdown-timeout: requests in flight go on, new ones get a 503

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        if scope["type"] != "http" or task is None:
            await self.app(scope, receive, send)
            return
        if self.draining or self.closing:
            await error_response(503, str(ShuttingDown()), "server_error", headers={"Connection": "close"})(
                scope, receive, send
            )
            return
        self.loop = asyncio.get_running_loop()
        self.tasks.add(task)
        started = False

        async def send_started(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_started)
        except asyncio.CancelledError:
            if not self.closing:
                raise
            if not started:
                with contextlib.suppress(Exception):
                    await error_response(503, str(ShuttingDown()), "server_error")(scope, receive, send)
        finally:
            self.tasks.discard(task)

    async def drain(self, timeout: float) -> None:
        """Wait until no request is in flight, or `timeout` seconds have passed."""
        deadline = time.monotonic() + timeout
        while self.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def close(self) -> None:
        """Start the grace period; safe from a signal handler."""
        self.closing = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.call_later, self.GRACE_S, self._cancel_rest)

    def _cancel_rest(self) -> None:
        for task in list(self.tasks):
            task.cancel()


# -- the app -------------------------------------------------------------------------------


def create_app(llm: Any, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app over `llm`: its collaborators built once, then each route module installed."""
    cfg = config or ServerConfig()
    metrics = ServerMetrics()
    engine = AsyncEngine(llm.driver, metrics)
    ctx = ServingContext.from_llm(llm, cfg.model_name, cfg.max_n)
    token_text = TokenText(llm.tokenizer)
    trimmer = limits.IdleTrimmer(llm.engine.has_unfinished)  # first: it caps malloc arenas
    work = limits.WorkPool()  # tokenizing, templates and grammars: never on the event loop
    names = list(dict.fromkeys([ctx.model_name, *cfg.aliases]))
    adapters = lora.Adapters(llm, names)
    for name, path in cfg.lora_modules:  # checked now: a bad adapter stops the server from starting
        adapters.add(name, path)
    models = ModelNames(names, adapters)
    gen = Generation(llm, engine, trimmer, work, adapters)

    app = FastAPI(
        title="pagedllm",
        version=__version__,
        lifespan=_lifespan(engine, ctx, trimmer, work),
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        root_path=cfg.root_path,
    )
    app.state.engine = engine
    app.state.metrics = metrics
    install_error_handlers(app)
    if cfg.api_key:
        app.add_middleware(AuthMiddleware, api_key=cfg.api_key)
    routes.add_cors(app, cfg.allowed_origins)  # outside the key check: preflights carry no key
    if cfg.record_requests:  # outermost: what the client sent, refused or not
        app.add_middleware(RequestRecorder, folder=cfg.record_requests)
    _install_basics(app, engine, metrics, ctx, models)
    generation.install(app, gen, ctx, token_text, models.check, cfg.max_body_bytes)
    served = routes.Served(llm, ctx, engine, token_text, models.check_base, work.run, cfg.max_body_bytes)
    routes.install(app, served)
    responses.install(app, served, gen, cfg.responses_store_size)
    anthropic.install(app, served, gen, cfg.keep_anthropic_attribution)
    embeddings.install(app, served)
    infill.install(app, served, gen)
    ollama.install(app, served, gen, models.names)
    lora.install(app, adapters, cfg.allow_runtime_lora)
    worker.install(app, llm, engine, ctx, names, cfg.tokenizer_path)
    return app


class ModelNames:
    """The names requests may use: the model's (and its aliases) and its LoRA adapters'."""

    def __init__(self, names: list[str], adapters: lora.Adapters) -> None:
        self.names, self.adapters = names, adapters

    def all_names(self) -> list[str]:
        return [*self.names, *self.adapters.by_name]

    def check(self, name: str | None) -> None:
        if name is not None and name not in self.names and self.adapters.get(name) is None:
            served = ", ".join(f"`{n}`" for n in self.all_names())
            raise ApiError(
                f"the model `{name}` does not exist; this server serves {served}",
                status=404,
                param="model",
                code="model_not_found",
            )

    def check_base(self, name: str | None) -> None:
        """The other routes (responses, embeddings, tokenize, a model's card) run the base model
        only: an adapter's name there is refused rather than answered by the base."""
        if self.adapters.get(name) is not None:
            raise ApiError(
                f"`{name}` is a LoRA adapter; adapters are served on /v1/completions and /v1/chat/completions only",
                param="model",
            )
        self.check(name)


def _lifespan(engine: AsyncEngine, ctx: ServingContext, trimmer: limits.IdleTrimmer, work: limits.WorkPool) -> Callable:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        logger.info(
            "serving %s (max_model_len %d, %d KV blocks of %d tokens)",
            ctx.model_name,
            ctx.max_model_len,
            ctx.usable_blocks,
            ctx.block_size,
        )
        trimming = asyncio.ensure_future(trimmer.run())
        try:
            yield
        finally:
            trimming.cancel()
            work.close()
            await asyncio.to_thread(engine.shutdown)

    return lifespan


def _install_basics(
    app: FastAPI, engine: AsyncEngine, metrics: ServerMetrics, ctx: ServingContext, models: ModelNames
) -> None:
    """The chat page, /health, /v1/models and /metrics."""

    @app.get("/")
    async def chat_page() -> Response:
        return HTMLResponse(_CHAT_PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            why = engine.stopped_because
            return error_response(503, "the engine is not running" + (f": {why}" if why else ""), "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        if anthropic_dialect.wants_anthropic(request.headers):
            return JSONResponse(anthropic_dialect.model_list(models.all_names(), ctx.started))
        cards = [ModelCard(id=n, max_model_len=ctx.max_model_len) for n in models.names]
        cards += [
            ModelCard(id=a.lora_name, root=a.lora_path, parent=ctx.model_name, max_model_len=ctx.max_model_len)
            for a in list(models.adapters.by_name.values())
        ]
        return JSONResponse(ModelList(data=cards).model_dump(exclude_none=True))

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)


@dataclass
class ServeResult:
    stopped_by: str | None  # the signal's name, e.g. "SIGINT"
    requests_ended: int  # requests in flight that the shutdown ended with an error


def run_server(
    llm: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    config: ServerConfig | None = None,
    log_level: str = "info",
    access_log: bool = False,
    sock: socket.socket | None = None,
) -> ServeResult:
    """Serve `llm` until SIGINT or SIGTERM. The first one stops admitting requests (new ones
    get a 503), lets those in flight run for up to `config.shutdown_timeout` seconds, then ends
    the rest (streams get an error event and [DONE], the others a 503), so the connections
    close and the engine thread stops; a second one exits at once.
    `sock`: a socket already listening on host:port (server/listen.py), opened before the
    model loaded; without it uvicorn opens its own."""
    cfg = config or ServerConfig()
    app = create_app(llm, cfg)
    engine: AsyncEngine = app.state.engine
    gate = ShutdownGate(app)
    # Requests end within a step of the signal; the timeout only guards against a stuck client.
    http = type("HTTP", (limits.HeaderTimeoutH11Protocol,), {"header_timeout": cfg.header_timeout})
    uv = uvicorn.Config(
        gate,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=1,
        http=http,
        timeout_keep_alive=cfg.keep_alive_timeout,
        limit_concurrency=cfg.max_connections,
        root_path=cfg.root_path,
    )
    server = _GracefulServer(uv, engine, gate, cfg.shutdown_timeout)
    server.run(sockets=[sock] if sock is not None else None)
    return ServeResult(server.stopped_by, engine.num_ended_at_shutdown)


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, stopped as run_server says: the first signal drains, a second exits."""

    stopped_by: str | None = None

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, gate: ShutdownGate, timeout: float) -> None:
        super().__init__(config)
        self.engine, self.gate, self.timeout = engine, gate, timeout

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Not recorded in uvicorn's captured signals: it would re-raise the signal after
        # the shutdown and turn a clean stop into a KeyboardInterrupt.
        if self.should_exit:
            os.write(2, b"second interrupt: exiting now\n")
            os._exit(130)
        self.stopped_by = signal.Signals(sig).name
        gate = self.gate
        if self.timeout > 0 and gate.loop is not None and gate.tasks and not gate.draining:
            gate.draining = True
            self.engine.stop_admitting()
            logger.info(
                "%s: waiting up to %.0f s for %d request(s) in flight", self.stopped_by, self.timeout, len(gate.tasks)
            )
            # (A signal handler may interrupt the loop anywhere: start the wait from it.)
            gate.loop.call_soon_threadsafe(self._start_drain, self.timeout)
            return
        self._stop_now()

    def _start_drain(self, timeout: float) -> None:
        self.drain_task = asyncio.ensure_future(self._drain_then_stop(timeout))

    async def _drain_then_stop(self, timeout: float) -> None:
        await self.gate.drain(timeout)
        self._stop_now()

    def _stop_now(self) -> None:
        self.engine.drain()
        self.gate.close()
        self.should_exit = True
