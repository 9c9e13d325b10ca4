"""The engine on its own thread, with an asyncio face for request handlers.

The engine is not thread-safe, so exactly one thread touches it, through the
engine driver (engine/driver.py). Handlers send commands (add, abort) through a
thread-safe queue; the thread applies them with the driver between steps and
hands each step's outputs back to the handler's event loop through a
per-submission asyncio queue. With no work the thread blocks on the
command queue, so an idle server costs no CPU.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ..engine.driver import EngineDriver, Item
from ..outputs import RequestOutput
from ..sampling.params import SamplingParams
from .metrics import ServerMetrics

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed (or is shutting down) while a request was in flight."""


class ShuttingDown(EngineError):
    """The server is stopping: a request in flight was ended, or a new one refused (HTTP 503)."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down; the request was not completed")


class RequestFailed(EngineError):
    """One request failed in the engine (non-finite logits); the others go on."""


@dataclass
class _Add:
    items: list[tuple[str, str | list[int], SamplingParams | None]]
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    accepted: asyncio.Future
    pooling: Any = None  # embedding requests: how to pool (engine/pooling.py's PoolingConfig)
    # When the handler queued them: the engine thread takes commands between steps, so the
    # requests' arrival is this, not the end of the step they came in during.
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class _Abort:
    request_id: str
    asked_at_step: int


_STOP = object()
_DRAIN = object()


@dataclass
class Submission:
    """The engine requests of one API call, whose outputs arrive on one queue."""

    request_ids: list[str]
    outputs: asyncio.Queue
    engine: "AsyncEngine"
    finals: dict[str, RequestOutput] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return len(self.finals) == len(self.request_ids)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for batch in self.batches():
            for item in batch:
                yield item

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        """The outputs in order, every one already queued at once: a stream that fell behind
        the engine catches up with one write instead of one per engine step."""
        while not self.finished:
            items = [await self.outputs.get()]
            while not self.outputs.empty():
                items.append(self.outputs.get_nowait())
            batch: list[RequestOutput] = []
            for item in items:
                if isinstance(item, BaseException):
                    if batch:
                        yield batch
                    raise item
                if item.finished:
                    self.finals[item.request_id] = item
                if item.error:  # the handler answers an error body / ends its stream with one
                    if batch:
                        yield batch
                    raise RequestFailed(item.error)
                batch.append(item)
            yield batch

    def final_outputs(self) -> list[RequestOutput]:
        return [self.finals[r] for r in self.request_ids]

    def abort_unfinished(self) -> None:
        for rid in self.request_ids:
            if rid not in self.finals:
                self.engine.abort(rid)


class AsyncEngine:
    def __init__(self, driver: EngineDriver, metrics: ServerMetrics | None = None) -> None:
        self.driver = driver  # the engine thread's add / abort / step
        self.engine = driver.engine
        self.metrics = metrics
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        # Only the engine thread reads or writes these.
        self._routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._steps = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # Why the engine thread stopped on its own: a rank of a distributed engine failed
        # (executor.dead), so no later step can run (requests then get a 503 at once).
        self.stopped_because: str | None = None
        self._closing = False
        self.num_ended_at_shutdown = 0  # requests in flight that drain() ended

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._cmds.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %.0f s", timeout)
        self._thread = None

    def drain(self) -> None:
        """Stop admitting requests and end every one in flight with `ShuttingDown`, freeing
        its KV blocks. Safe to call from a signal handler (it only sets a flag and queues)."""
        self._closing = True
        self._cmds.put(_DRAIN)

    def stop_admitting(self) -> None:
        """Refuse new requests (`ShuttingDown`) while those in flight go on."""
        self._closing = True

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- handler side (any thread with a running event loop) ----------------------------
    async def submit(
        self, items: list[tuple[str, str | list[int], SamplingParams | None]], pooling: Any = None
    ) -> Submission:
        """Add the requests atomically (all or none); raises ValueError for bad input. With
        `pooling`, they are embedding requests (token ids, params None).

        Callers must call `abort_unfinished()` on the result when they stop early, and
        should do so even when this raises (a cancelled wait may still have added them).
        """
        if self._closing:
            raise ShuttingDown()
        if not self.alive:
            raise EngineError(
                "the engine is not running" + (f": {self.stopped_because}" if self.stopped_because else "")
            )
        loop = asyncio.get_running_loop()
        sub = Submission([it.request_id for it in items], asyncio.Queue(), self)
        accepted = loop.create_future()
        self._cmds.put(_Add(items, loop, sub.outputs, accepted, pooling))
        try:
            await accepted
        except asyncio.CancelledError:
            sub.abort_unfinished()
            raise
        return sub

    def abort(self, request_id: str) -> None:
        self._cmds.put(_Abort(request_id, self._steps))

    async def embed(self, prompts: list[list[int]], pooling: Any) -> list[Any]:
        """Embeddings of token-id prompts: pooling requests, scheduled with every other request's
        work (prefill chunks beside the decodes); raises ValueError for bad input. A handler
        that stops waiting (its client gone) aborts them."""
        tag = uuid.uuid4().hex[:16]
        sub = await self.submit([Item(f"embd-{tag}-{i}", p, None) for i, p in enumerate(prompts)], pooling)
        try:
            async for _ in sub:
                pass
        finally:
            sub.abort_unfinished()
        return [out.embedding for out in sub.final_outputs()]

    # -- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        logger.info("engine thread started")
        try:
            while True:
                idle = not self.driver.has_unfinished()
                if not self._apply_commands(block=idle):
                    break
                if self.driver.has_unfinished():
                    if not self._step():
                        break
                elif self.metrics is not None:
                    self.metrics.on_engine_state(self.engine, len(self._routes))
        finally:
            self._fail_all(ShuttingDown())
            logger.info("engine thread stopped")

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False once asked to stop."""
        try:
            cmd = self._cmds.get(block=block)
        except queue.Empty:
            return True
        while True:
            if cmd is _STOP:
                return False
            if cmd is _DRAIN:
                self.num_ended_at_shutdown += len(self._routes)
                self._fail_all(ShuttingDown())
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                self._abort(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return True

    def _add(self, cmd: _Add) -> None:
        if self._closing:  # queued before the drain, applied after it
            _call_soon(cmd.loop, _settle, cmd.accepted, ShuttingDown())
            return
        try:
            if cmd.pooling is None:
                added = self.driver.add(cmd.items)  # all or none
            else:
                added = self.driver.add_pooling(cmd.items, cmd.pooling)
        except Exception as e:  # bad input: report to the caller
            err = e if isinstance(e, ValueError) else EngineError(f"{type(e).__name__}: {e}")
            if not isinstance(e, ValueError):
                logger.exception("adding a request failed")
            _call_soon(cmd.loop, _settle, cmd.accepted, err)
            return
        for rid in added:
            self._routes[rid] = (cmd.loop, cmd.outputs)
            req = self.engine.requests.get(rid)
            if req is not None:
                req.metrics.arrival_time = cmd.submitted
                if self.metrics is not None:
                    self.metrics.on_prompt(len(req.prompt_token_ids))
        _call_soon(cmd.loop, _settle, cmd.accepted, None)

    def _abort(self, cmd: _Abort) -> None:
        if self._routes.pop(cmd.request_id, None) is None:
            return  # finished already, or never added
        self.driver.abort([cmd.request_id])
        logger.info("aborted request %s", cmd.request_id)
        if self.metrics is not None:
            self.metrics.aborts.inc()
            self.metrics.abort_delay_steps.observe(self._steps - cmd.asked_at_step)
            self.metrics.forget(cmd.request_id)
            self.metrics.on_engine_state(self.engine, len(self._routes))

    def _step(self) -> bool:
        """One engine step and its outputs delivered; False when the engine cannot go on."""
        try:
            outs = self.driver.advance()
        except Exception as e:
            logger.exception("engine step failed; failing the requests in flight")
            if self.metrics is not None:
                self.metrics.engine_errors.inc()
            if self.engine.executor is not None and self.engine.executor.dead:
                # A pipeline stage or tensor-parallel rank died or hung: every later step would
                # fail too, so the thread stops and new requests get a 503 instead.
                self.stopped_because = (
                    "a rank of the distributed engine failed (the server log says which and how); restart the server"
                )
                self._fail_all(EngineError(f"the engine stopped: {self.stopped_because}"))
                return False
            self._fail_all(EngineError(f"internal engine error ({type(e).__name__})"))
            return True
        self._steps += 1
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = defaultdict(list)
        for out in outs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            if out.finished:
                del self._routes[out.request_id]
            batches[route[0]].append((route[1], out))
        for loop, items in batches.items():
            _call_soon(loop, _deliver, items)
        if self.metrics is not None:
            self.metrics.on_step_outputs(outs)
            self.metrics.on_engine_state(self.engine, len(self._routes))
        return True

    def _fail_all(self, err: BaseException) -> None:
        routes, self._routes = self._routes, {}
        for rid, (loop, q) in routes.items():
            try:
                self.driver.abort([rid])
            except Exception:  # the engine may be broken; the request is dropped either way
                logger.exception("abort of %s failed", rid)
            _call_soon(loop, _deliver, [(q, err)])


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that loop is closed: nobody is listening any more
        pass


def _settle(fut: asyncio.Future, err: BaseException | None) -> None:
    if fut.done():  # the waiting handler was cancelled
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)
