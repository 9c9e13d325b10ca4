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

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from .._version import __version__
from ..structured import limits as grammar_limits
from . import embeddings, limits, lora, responses, routes
from .async_engine import AsyncEngine, EngineError, ShuttingDown, Submission
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from .serving import ApiError, Call, ServingContext, TokenText, chat_call, completion_call, sse_line

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
_CHAT_PAGE = Path(__file__).parent / "static" / "chat.html"  # the chat page at GET /
_STATUS_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                 429: "rate_limit_error"}


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


# -- errors ----------------------------------------------------------------------------


def error_response(status: int, message: str, type: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    if type is None:
        type = _STATUS_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _validation_message(err: ValidationError | RequestValidationError) -> tuple[str, str | None]:
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


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = exc.detail if isinstance(exc.detail, str) else "request failed"
        return error_response(exc.status_code, msg, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return error_response(400, msg, param=param)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")  # the trace goes to the log, never to the client
        return error_response(500, "internal server error", "server_error")


class AuthMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which would hide client disconnects from the routes)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") != "/health":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                msg = ("missing API key: send 'Authorization: Bearer KEY'" if not given
                       else "invalid API key")
                resp = error_response(401, msg, code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
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
            await error_response(503, str(ShuttingDown()), "server_error",
                                 headers={"Connection": "close"})(scope, receive, send)
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


# -- request bodies ------------------------------------------------------------------------


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
        msg, param = _validation_message(e)
        raise ApiError(msg, param=param) from None


# -- streaming -------------------------------------------------------------------------------


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


_sse = sse_line


def _sse_error(exc: Exception) -> str:
    body = ErrorResponse(error=ErrorInfo(message=str(exc), type="server_error"))
    return f"data: {body.model_dump_json()}\n\n"


async def _events(sub: Submission, start: list, events: Callable, usage: Callable | None,
                  include_usage: bool) -> AsyncIterator[str]:
    """The stream's server-sent events: `events(output, include_usage)` renders one output's;
    the outputs queued together go out as one write."""
    try:
        for c in start:
            yield _sse(c, include_usage)
        async for outs in sub.batches():
            text = "".join(line for out in outs for line in events(out, include_usage))
            if text:
                yield text
        if usage is not None:
            yield _sse(usage(sub.final_outputs()), True)
        yield "data: [DONE]\n\n"
    except EngineError as e:
        yield _sse_error(e)
        yield "data: [DONE]\n\n"
    finally:
        # Runs on normal end, on error and on cancellation (client gone): abort what is left.
        sub.abort_unfinished()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_gone(work: Any, request: Request) -> Any:
    """Await `work`, unless the client disconnects first: then cancel it (a cancelled
    `AsyncEngine.submit` aborts what it added) and answer 499."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
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


async def _collect(sub: Submission, request: Request) -> list | None:
    """Wait for every request of `sub` to finish; None if the client left first (then abort)."""
    async def consume() -> None:
        async for _ in sub:
            pass

    work = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
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


# -- the app -------------------------------------------------------------------------------


def create_app(llm: Any, config: ServerConfig | None = None) -> FastAPI:
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

    def check_model(name: str | None) -> None:
        if name is not None and name not in names and adapters.get(name) is None:
            served = ", ".join(f"`{n}`" for n in [*names, *adapters.by_name])
            raise ApiError(f"the model `{name}` does not exist; this server serves {served}",
                           status=404, param="model", code="model_not_found")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        logger.info("serving %s (max_model_len %d, %d KV blocks of %d tokens)", ctx.model_name,
                    ctx.max_model_len, ctx.usable_blocks, ctx.block_size)
        trimming = asyncio.ensure_future(trimmer.run())
        try:
            yield
        finally:
            trimming.cancel()
            work.close()
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url="/openapi.json")
    app.state.engine = engine
    app.state.metrics = metrics
    _install_error_handlers(app)
    if cfg.api_key:
        app.add_middleware(AuthMiddleware, api_key=cfg.api_key)
    routes.add_cors(app, cfg.allowed_origins)  # outside the key check: preflights carry no key

    async def submit(items: list, request: Request, grammar_param: str = "response_format") -> Submission:
        # A client gone before its requests are accepted aborts them in the same command batch:
        # they never reach the scheduler, so they cost no step. A few loop turns first let the
        # loop read an EOF that came while the request was being prepared (the selector's read
        # callback runs after this task's wake-up, and connection_lost one turn later): an idle
        # engine accepts an add at once, before a watcher started with it could post the abort.
        for _ in range(3):
            await asyncio.sleep(0)
        if await request.is_disconnected():
            raise ApiError("the client closed the request", status=499)
        return await _unless_gone(_submit(items, grammar_param), request)

    async def _submit(items: list, grammar_param: str) -> Submission:
        # A grammar is checked (and llguidance's token trie built, once) off the engine thread.
        trimmer.note_work()
        specs = {id(it[2].structured): it[2].structured for it in items if it[2].structured is not None}
        for spec in specs.values():
            try:
                await work.run(llm.engine.structured.prepare, spec,
                               timeout=grammar_limits.COMPILE_TIMEOUT_S)
            except ValueError as e:
                raise ApiError(str(e), param=grammar_param) from None
            except asyncio.TimeoutError:
                raise ApiError(f"the grammar did not compile within {grammar_limits.COMPILE_TIMEOUT_S:.0f} "
                               "s; simplify it", param=grammar_param) from None
        try:
            return await engine.submit(items)
        except ValueError as e:
            msg = str(e)
            code = "context_length_exceeded" if "max_model_len" in msg else None
            raise ApiError(msg, code=code) from None
        except EngineError as e:
            raise ApiError(str(e), status=503, type="server_error") from None

    def with_adapter(call: Call, model: str | None) -> Call:
        """The call's requests run with the adapter its `model` names (none for the base)."""
        req = adapters.get(model)
        if req is not None:
            call.items = [(*it[:3], req) for it in call.items]
        return call

    async def answer(call: Call, request: Request) -> Response:
        """Run a chat or completion call on the engine; its stream, or its whole answer."""
        sub = await submit(call.items, request, call.grammar_param)
        if call.stream:
            events = _events(sub, call.streamer.start(), call.streamer.events, call.usage_chunk(),
                             call.include_usage)
            return SSEResponse(events, sub.abort_unfinished)
        finals = await _collect_or_fail(sub, request)
        if finals is None:
            return Response(status_code=499)
        return JSONResponse(call.response(finals).model_dump(exclude_none=False))

    @app.get("/")
    async def chat_page() -> Response:
        return HTMLResponse(_CHAT_PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return error_response(503, "the engine is not running", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
        cards = [ModelCard(id=n, max_model_len=ctx.max_model_len) for n in names]
        cards += [ModelCard(id=a.lora_name, root=a.lora_path, parent=ctx.model_name, max_model_len=ctx.max_model_len)
                  for a in list(adapters.by_name.values())]
        return JSONResponse(ModelList(data=cards).model_dump(exclude_none=True))

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = parse(ChatCompletionRequest, await read_json(request, cfg.max_body_bytes))
        check_model(req.model)
        limits.check_prompt_chars(limits.chat_chars(req), ctx.max_model_len, "messages")
        call = await work.run(chat_call, req, ctx, token_text)
        return await answer(with_adapter(call, req.model), request)

    def check_base_model(name: str | None) -> None:
        """The other routes (responses, embeddings, tokenize, a model's card) run the base model
        only: an adapter's name there is refused rather than answered by the base."""
        if adapters.get(name) is not None:
            raise ApiError(f"`{name}` is a LoRA adapter; adapters are served on /v1/completions and "
                           "/v1/chat/completions only", param="model")
        check_model(name)

    served = routes.Served(llm, ctx, cfg, names, engine, token_text, check_base_model, submit,
                           lambda request, model: _read_body(request, model, cfg.max_body_bytes),
                           SSEResponse, _collect_or_fail, work.run)
    routes.install(app, served)
    responses.install(app, served, cfg.responses_store_size)
    embeddings.install(app, served)
    lora.install(app, adapters, cfg.allow_runtime_lora)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse(CompletionRequest, await read_json(request, cfg.max_body_bytes))
        check_model(req.model)
        for p in [req.prompt] if isinstance(req.prompt, str) else req.prompt or []:
            if isinstance(p, str):
                limits.check_prompt_chars(len(p), ctx.max_model_len, "prompt")
        call = await work.run(completion_call, req, ctx, token_text)
        return await answer(with_adapter(call, req.model), request)

    return app


async def _read_body(request: Request, model: type[BaseModel], limit: int) -> Any:
    return parse(model, await read_json(request, limit))


async def _collect_or_fail(sub: Submission, request: Request) -> list | None:
    try:
        return await _collect(sub, request)
    except EngineError as e:
        status = 503 if isinstance(e, ShuttingDown) else 500
        raise ApiError(str(e), status=status, type="server_error") from None


@dataclass
class ServeResult:
    stopped_by: str | None  # the signal's name, e.g. "SIGINT"
    requests_ended: int  # requests in flight that the shutdown ended with an error


def run_server(llm: Any, host: str = "127.0.0.1", port: int = 8000, config: ServerConfig | None = None,
               log_level: str = "info", access_log: bool = False, sock: socket.socket | None = None) -> ServeResult:
    """Serve `llm` until SIGINT or SIGTERM. The first one stops admitting requests (new ones
    get a 503), lets those in flight run for up to `config.shutdown_timeout` seconds, then ends
    the rest (streams get an error event and [DONE], the others a 503), so the connections
    close and the engine thread stops; a second one exits at once.
    `sock`: a socket already listening on host:port (server/listen.py), opened before the
    model loaded; without it uvicorn opens its own."""
    import uvicorn

    class Server(uvicorn.Server):
        stopped_by: str | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            # Not recorded in uvicorn's captured signals: it would re-raise the signal after
            # the shutdown and turn a clean stop into a KeyboardInterrupt.
            if self.should_exit:
                os.write(2, b"second interrupt: exiting now\n")
                os._exit(130)
            self.stopped_by = signal.Signals(sig).name
            timeout = cfg.shutdown_timeout
            if timeout > 0 and gate.loop is not None and gate.tasks and not gate.draining:
                gate.draining = True
                engine.stop_admitting()
                logger.info("%s: waiting up to %.0f s for %d request(s) in flight", self.stopped_by,
                            timeout, len(gate.tasks))
                # (A signal handler may interrupt the loop anywhere: start the wait from it.)
                gate.loop.call_soon_threadsafe(self._start_drain, timeout)
                return
            self._stop_now()

        def _start_drain(self, timeout: float) -> None:
            self.drain_task = asyncio.ensure_future(self._drain_then_stop(timeout))

        async def _drain_then_stop(self, timeout: float) -> None:
            await gate.drain(timeout)
            self._stop_now()

        def _stop_now(self) -> None:
            engine.drain()
            gate.close()
            self.should_exit = True

    cfg = config or ServerConfig()
    app = create_app(llm, cfg)
    engine: AsyncEngine = app.state.engine
    gate = ShutdownGate(app)
    # Requests end within a step of the signal; the timeout only guards against a stuck client.
    cfg = config or ServerConfig()
    http = type("HTTP", (limits.HeaderTimeoutH11Protocol,), {"header_timeout": cfg.header_timeout})
    uv = uvicorn.Config(gate, host=host, port=port, log_level=log_level, access_log=access_log,
                        timeout_graceful_shutdown=1, http=http, timeout_keep_alive=cfg.keep_alive_timeout,
                        limit_concurrency=cfg.max_connections)
    server = Server(uv)
    server.run(sockets=[sock] if sock is not None else None)
    return ServeResult(server.stopped_by, engine.num_ended_at_shutdown)
