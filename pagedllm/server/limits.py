"""What keeps one hostile request from crashing, stalling or exhausting the server.

- `WorkPool`: a few threads with large stacks where request preparation (tokenizing, chat
  template rendering, grammar compilation) runs, so the event loop keeps answering.
- `load_json`: request bodies parsed with a nesting-depth limit, an integer-size limit and no
  lone surrogates, each refused with a 400 that names the field.
- `HeaderTimeoutH11Protocol`: uvicorn's h11 protocol, plus a deadline for a request's headers.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import logging
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import pydantic_core
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..protocols.common.errors import ApiError

logger = logging.getLogger(__name__)

MAX_JSON_DEPTH = 128  # nested arrays/objects in a request body
MAX_INT_DIGITS = 4300  # Python's own int-from-string limit; past it, a 400 rather than a ValueError
# A prompt longer than max_model_len x this many characters cannot fit: refused before tokenizing.
MAX_CHARS_PER_TOKEN = 32
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_KEEP_ALIVE_S = 5.0
WORK_THREADS = 4
WORK_STACK_BYTES = 64 * 2**20  # grammar compilation recurses: see pagedllm.structured.limits
MALLOC_ARENAS = 2  # glibc's default is 8 per core; each arena keeps its own free pages


# -- off the event loop ------------------------------------------------------------------------


class WorkPool:
    """A fixed number of threads with big stacks (threading.stack_size only applies to threads
    started after it, so they are all started here, at once, under a lock)."""

    _stack_lock = threading.Lock()

    def __init__(self, threads: int = WORK_THREADS, stack_bytes: int = WORK_STACK_BYTES) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = []
        with self._stack_lock:
            old = threading.stack_size(stack_bytes)
            try:
                for i in range(threads):
                    t = threading.Thread(target=self._work, name=f"pagedllm-prepare-{i}", daemon=True)
                    t.start()
                    self._threads.append(t)
            finally:
                threading.stack_size(old)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the awaiting request
                fut.set_exception(e)

    async def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """fn(*args) on a pool thread. On timeout the request gets TimeoutError at once; the
        thread finishes the call (it cannot be interrupted) and then takes the next job."""
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)


def check_prompt_chars(chars: int, max_model_len: int, param: str) -> None:
    """Refuse, before tokenizing, text that cannot fit the context whatever its tokens."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise ApiError(
            f"{param}: {chars} characters, more than this model's context of {max_model_len} "
            f"tokens can hold ({limit}, at {MAX_CHARS_PER_TOKEN} per token); shorten it",
            param=param,
            code="context_length_exceeded",
        )


def chat_chars(req: Any) -> int:
    """The characters of a chat request's message texts (what the template renders around)."""
    total = 0
    for m in req.messages or []:
        content = m.content
        if isinstance(content, str):
            total += len(content)
        elif content:
            total += sum(len(part.text or "") for part in content)
    return total


# -- request bodies ------------------------------------------------------------------------------


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _BigInt(len(text))
    return int(text)


class _BigInt(ValueError):
    pass


def load_json(raw: bytes) -> Any:
    """The body's JSON value, or an ApiError (400) saying what is wrong with it. pydantic-core's
    parser first (several times faster than json.loads, which holds the GIL meanwhile); what it refuses is parsed
    again by json.loads, whose errors say which field is wrong."""
    try:
        body = pydantic_core.from_json(raw)
    except ValueError:
        body = _load_json_slowly(raw)
    _check_tree(body)
    return body


def _load_json_slowly(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_int=_parse_int)
    except _BigInt as e:
        raise ApiError(
            f"request body holds an integer of {e.args[0]} digits; at most {MAX_INT_DIGITS} are allowed"
        ) from None
    except RecursionError:
        raise ApiError(f"request body is nested deeper than the limit of {MAX_JSON_DEPTH} arrays/objects") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"request body is not valid JSON: {e}") from None


async def load_json_off_loop(raw: bytes) -> Any:
    """`load_json`, on a worker thread for a large body (parsing and checking one takes long
    enough to stall the event loop)."""
    if len(raw) < 2**16:
        return load_json(raw)
    return await asyncio.to_thread(load_json, raw)


def _check_tree(body: Any) -> None:
    """Depth and lone surrogates, walked without recursion; `param` names the first bad field."""
    stack: list[tuple[Any, tuple, int]] = [(body, (), 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise ApiError(
                    f"request body is nested deeper than the limit of {MAX_JSON_DEPTH} arrays/objects",
                    param=_param(path) or None,
                )
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for k, v in items:
                if isinstance(k, str):
                    _check_text(k, path + (k,))
                stack.append((v, path + (k,), depth + 1))
        elif isinstance(node, str):
            _check_text(node, path)


def _check_text(s: str, path: tuple) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        where = _param(path) or "request body"
        raise ApiError(
            f"{where} holds a lone UTF-16 surrogate ({s[e.start]!r} at position {e.start}), "
            "which is not valid Unicode text",
            param=_param(path) or None,
        ) from None


def _param(path: tuple) -> str:
    return ".".join(str(p) for p in path)


# -- memory -------------------------------------------------------------------------------------


class IdleTrimmer:
    """glibc keeps what a burst of requests freed in its malloc arenas (one per thread that
    allocated: the engine, the preparing threads, torch's), so a server's RSS after a storm
    stays near its peak with nothing in flight. Once the engine is idle after some work,
    malloc_trim(0) hands the free pages back to the system (a few ms, off the event loop)."""

    def __init__(self, busy: Callable[[], bool], every_s: float = 2.0) -> None:
        self.busy, self.every_s = busy, every_s
        self._dirty = False
        libc = _glibc()
        self._trim = libc.malloc_trim if libc is not None else None
        if libc is not None and "MALLOC_ARENA_MAX" not in os.environ:
            # Threads started from now on (the engine's, the preparing ones) share these few.
            libc.mallopt(_M_ARENA_MAX, MALLOC_ARENAS)

    def note_work(self) -> None:
        self._dirty = True

    async def run(self) -> None:
        if self._trim is None:
            return
        while True:
            await asyncio.sleep(self.every_s)
            if self._dirty and not self.busy():
                self._dirty = False
                await asyncio.to_thread(self._trim, 0)


_M_ARENA_MAX = -8  # glibc's malloc.h


def _glibc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:  # not glibc (musl, macOS): nothing to trim
        return None


# -- connections ----------------------------------------------------------------------------------


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn closes an idle kept-alive connection, but waits forever for a request's headers
    (a slowloris client, or one that sent half a request line). This closes a connection whose
    request headers have not all arrived `header_timeout` seconds after its first byte (or
    after the connection opened)."""

    header_timeout = DEFAULT_HEADER_TIMEOUT_S

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        waiting_before = self._waiting_for_headers()
        if waiting_before:
            self._arm_header_timer()
        super().data_received(data)
        if not self._waiting_for_headers():
            self._disarm_header_timer()

    def _waiting_for_headers(self) -> bool:
        import h11

        return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self._waiting_for_headers():
            logger.debug("closing a connection whose request headers took over %.0f s", self.header_timeout)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)
