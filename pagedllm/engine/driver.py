"""The one loop over the engine: add (all or none), step, abort, and the outputs of chosen requests.

Every face drives the engine through an `EngineDriver`: `LLM` and the mistral.rs-style `Runner`
(`finals`, `stream`), the CLI and the bench (`steps`), and the server's `AsyncEngine`, whose engine
thread calls `add`, `abort` and `advance` (one step) between its commands. Nothing else calls
`LLMEngine.step()`. Not thread-safe: one thread drives one engine.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Iterator, NamedTuple

from ..native import release_omp_threads
from ..outputs import RequestOutput, raise_failed
from ..sampling.params import SamplingParams

Prompt = str | list[int]


class Item(NamedTuple):
    """One request for the engine."""

    request_id: str | None  # None: a fresh one
    prompt: Any  # text, token ids or a MultiModalInput
    params: SamplingParams | None = None  # None: a pooling (embedding) request's
    lora: Any = None  # the LoRARequest it runs with; None: the base model


def _items(items: Iterable[Item | tuple]) -> Iterator[Item]:
    """Items, from Items or from plain tuples in Item's order."""
    return (it if isinstance(it, Item) else Item(*it) for it in items)


class EngineDriver:
    def __init__(self, engine: Any) -> None:
        self.engine = engine

    # -- the async face's primitives (and the sync face's) --------------------------------
    def add(self, items: Iterable[Item | tuple]) -> list[str]:
        """Add the requests, all or none: if one is refused (bad input raises ValueError), those
        already added are aborted before the error goes on. Their request ids, in order."""
        return self._all_or_none(
            self.engine.add_request(
                it.prompt, it.params, request_id=it.request_id, **({"lora_request": it.lora} if it.lora else {})
            )
            for it in _items(items)
        )

    def add_pooling(self, items: Iterable[Item | tuple], pooling: Any) -> list[str]:
        """Add embedding requests (their prompts are token ids), all or none, pooled as
        `pooling` (engine/pooling.py's PoolingConfig) says; their final outputs carry `embedding`."""
        return self._all_or_none(
            self.engine.add_pooling_request(it.prompt, pooling, request_id=it.request_id) for it in _items(items)
        )

    def _all_or_none(self, adds: Iterator[str]) -> list[str]:
        added: list[str] = []
        try:
            for rid in adds:
                added.append(rid)
        except BaseException:
            self.abort(added)
            raise
        return added

    def abort(self, request_ids: Iterable[str]) -> None:
        """End the requests and free their blocks; ids already finished (or unknown) are skipped."""
        for rid in request_ids:
            self.engine.abort(rid)

    def advance(self) -> list[RequestOutput]:
        """One engine step: the outputs of every request it touched."""
        outs = self.engine.step()
        if not self.engine.has_unfinished():
            # Idle: this thread's OpenMP workers go, so that the next thread to drive the engine
            # (the server's, a user's) finds its own spinning between regions (native/__init__.py).
            release_omp_threads()
        return outs

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def paced(self, arrivals: list[tuple[float, Item]]) -> Iterator[tuple[float, list[RequestOutput]]]:
        """Arrival-paced driving, as a server's engine thread sees its clients: each item is added
        at its arrival (seconds from the start; the list in arrival order), between steps, and
        the engine sleeps only while idle. Yields (seconds since the start, the step's outputs)
        after each step, until every item has arrived and finished."""
        t0, nxt = time.perf_counter(), 0
        while nxt < len(arrivals) or self.has_unfinished():
            now = time.perf_counter() - t0
            if not self.has_unfinished() and arrivals[nxt][0] > now:
                time.sleep(arrivals[nxt][0] - now)
                now = time.perf_counter() - t0
            due = []
            while nxt < len(arrivals) and arrivals[nxt][0] <= now:
                due.append(arrivals[nxt][1])
                nxt += 1
            if due:
                self.add(due)
            outs = self.advance()
            yield time.perf_counter() - t0, outs

    # -- the sync face ------------------------------------------------------------------------
    def steps(self, request_ids: Iterable[str] | None = None) -> Iterator[list[RequestOutput]]:
        """Step until the given requests have finished (None: until the engine is idle), yielding
        each step's outputs of them (the list may be empty). Leaving early (closing it, or an
        exception inside, Ctrl-C included) aborts those not finished."""
        wanted = None if request_ids is None else set(request_ids)
        pending = set() if wanted is None else set(wanted)
        try:
            while pending if wanted is not None else self.engine.has_unfinished():
                if not self.engine.has_unfinished():
                    raise RuntimeError(
                        f"request(s) {', '.join(sorted(pending))} are no longer in the engine (aborted elsewhere?)"
                    )
                outs = self.advance()
                if wanted is not None:
                    outs = [o for o in outs if o.request_id in wanted]
                    pending.difference_update(o.request_id for o in outs if o.finished)
                yield outs
        finally:
            self.abort(pending)

    def outputs(self, request_ids: Iterable[str]) -> Iterator[RequestOutput]:
        """Every output of the requests as it comes, until all have finished (see `steps`)."""
        for outs in self.steps(request_ids):
            yield from outs

    def finals(self, request_ids: list[str], on_finished: Any = None) -> list[RequestOutput]:
        """Run requests already added to the end; their final outputs, in order. `on_finished(output)`
        is called as each finishes. Raises `RequestFailedError` if one failed, with every final
        output on it."""
        done: dict[str, RequestOutput] = {}
        for out in self.outputs(request_ids):
            if out.finished:
                done[out.request_id] = out
                if on_finished is not None:
                    on_finished(out)
        outs = [done[r] for r in request_ids]
        raise_failed(outs)  # the others ran to the end: they are on the error's `outputs`
        return outs

    def stream(self, request_ids: list[str]) -> Iterator[RequestOutput]:
        """The outputs of requests already added, as they come; a failed request raises
        `RequestFailedError` with its output (the stream ends there, the rest are aborted)."""
        for out in self.outputs(request_ids):
            raise_failed([out])
            yield out
