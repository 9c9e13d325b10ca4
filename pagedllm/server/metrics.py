"""Prometheus metrics for the server, in a registry of its own (several apps may share a process).

Engine-state gauges are written by the engine thread after each step, so a
scrape never reads the (not thread-safe) engine directly.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client import CONTENT_TYPE_LATEST

from ..outputs import RequestOutput

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends
        self._declare_engine_state("pagedllm_", r)
        self._declare_counts("pagedllm_", r)
        self._declare_latency("pagedllm_", r)
        self._last_token: dict[str, dict[int, float]] = {}  # request -> choice -> time
        self._seen_first: set[str] = set()
        self._preempt_seen = 0

    def _declare_engine_state(self, p: str, r: CollectorRegistry) -> None:
        """What the scheduler and the KV cache hold right now (gauges)."""
        self.running = Gauge(
            p + "num_requests_running", "Sequences the scheduler is running (one per choice of a request)", registry=r
        )
        self.waiting = Gauge(p + "num_requests_waiting", "Sequences waiting to be scheduled", registry=r)
        self.in_flight = Gauge(
            p + "num_http_requests_in_flight", "Engine requests the server is waiting on", registry=r
        )
        self.blocks_used = Gauge(p + "kv_blocks_used", "KV cache blocks in use", registry=r)
        self.blocks_free = Gauge(p + "kv_blocks_free", "KV cache blocks free", registry=r)
        self.blocks_total = Gauge(p + "kv_blocks_total", "Usable KV cache blocks", registry=r)
        self.blocks_touched = Gauge(
            p + "kv_blocks_touched",
            "Distinct KV blocks ever handed out: with lazily allocated CPU pools, the blocks whose memory is committed",
            registry=r,
        )
        self.blocks_peak_used = Gauge(p + "kv_blocks_peak_used", "Most KV blocks in use at once", registry=r)
        self.blocks_cached = Gauge(
            p + "kv_blocks_cached", "Blocks held by the prefix cache (0 without prefix caching)", registry=r
        )
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Share of KV cache blocks in use", registry=r)
        # Tensor or pipeline parallelism: what each rank holds (one rank without either; a
        # pipeline stage's KV cache holds its own layers of every block, so the ranks' sum is
        # the whole cache's bytes).
        self.rank_kv_bytes = Gauge(
            p + "rank_kv_cache_bytes", "KV cache bytes a rank holds (its pools' ceiling)", ["rank"], registry=r
        )
        self.rank_weight_bytes = Gauge(
            p + "rank_weight_bytes", "Resident weight bytes a rank holds", ["rank"], registry=r
        )
        self._ranks_set = False
        self.prefix_hit_rate = Gauge(
            p + "prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens looked up",
            registry=r,
        )

    def _declare_counts(self, p: str, r: CollectorRegistry) -> None:
        """What has happened so far: tokens, finishes, aborts, preemptions, speculation (counters)."""
        self.preemptions = Counter(p + "preemptions", "Sequences preempted for lack of blocks", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens admitted", registry=r)
        self.cached_prompt_tokens = Counter(
            p + "cached_prompt_tokens", "Prompt tokens found in the prefix cache", registry=r
        )
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.requests_finished = Counter(
            p + "requests_finished", "Sequences (choices) that ended, by finish reason", ["reason"], registry=r
        )
        self.aborts = Counter(p + "requests_aborted", "Requests aborted (client gone or error)", registry=r)
        self.abort_delay_steps = Histogram(
            p + "abort_delay_steps",
            "Engine steps between an abort being asked and done",
            buckets=(0, 1, 2, 5, 10),
            registry=r,
        )
        self.spec_proposed = Counter(
            p + "spec_decode_num_draft_tokens", "Speculative draft tokens verified", registry=r
        )
        self.spec_accepted = Counter(
            p + "spec_decode_num_accepted_tokens", "Speculative draft tokens accepted", registry=r
        )
        self.spec_acceptance = Gauge(
            p + "spec_decode_acceptance_rate", "Accepted / verified draft tokens so far", registry=r
        )
        self.spec_mean_len = Gauge(
            p + "spec_decode_mean_accepted_length", "Draft tokens accepted per verification so far", registry=r
        )
        self._spec_seen = (0, 0)

    def _declare_latency(self, p: str, r: CollectorRegistry) -> None:
        """How long things took: steps, first tokens, queueing, tokens, whole requests."""
        self.steps = Counter(p + "engine_steps", "Engine steps run", registry=r)
        self.engine_errors = Counter(p + "engine_errors", "Engine steps that raised", registry=r)
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            p + "request_queue_time_seconds",
            "Arrival to the first scheduled step (time spent waiting behind other requests)",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds", "Time between tokens of a sequence", buckets=ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(p + "request_latency_seconds", "Arrival to last token", buckets=E2E_BUCKETS, registry=r)

    # -- called from the engine thread ------------------------------------------------
    def on_step_outputs(self, outs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        self.steps.inc()
        for out in outs:
            rid = out.request_id
            if rid not in self._seen_first:
                self._seen_first.add(rid)
                ttft = out.metrics.time_to_first_token
                if ttft is not None:
                    self.ttft.observe(ttft)
                queued = out.metrics.queue_time
                if queued is not None:
                    self.queue_time.observe(queued)
                self.cached_prompt_tokens.inc(out.num_cached_tokens)
            for c in out.outputs:
                k = len(c.delta_token_ids)
                if not k:
                    continue
                self.generation_tokens.inc(k)
                times = self._last_token.setdefault(rid, {})
                last = times.get(c.index)
                if last is not None:
                    for _ in range(k):
                        self.itl.observe((now - last) / k)
                times[c.index] = now
            if out.finished:
                self.forget(rid)
                total = out.metrics.total_time
                if total is not None:
                    self.e2e.observe(total)
                for c in out.outputs:
                    self.requests_finished.labels(reason=c.finish_reason or "unknown").inc()

    def forget(self, rid: str) -> None:
        self._seen_first.discard(rid)
        self._last_token.pop(rid, None)

    def on_engine_state(self, engine: Any, in_flight: int) -> None:
        sched, bm = engine.scheduler, engine.block_manager
        if not self._ranks_set:  # fixed once the engine is built
            self._ranks_set = True
            ranks = engine.executor.rank_bytes if engine.executor is not None else None
            if not ranks:
                w = engine.weights.resident_bytes if engine.weights is not None else 0
                kv = engine.kv_cache.nbytes if engine.kv_cache is not None else 0
                ranks = [(w, kv)]
            for i, (w, kv) in enumerate(ranks):
                self.rank_weight_bytes.labels(str(i)).set(w)
                self.rank_kv_bytes.labels(str(i)).set(kv)
        self.running.set(sched.num_running)
        self.waiting.set(sched.num_waiting)
        self.in_flight.set(in_flight)
        used, total = bm.num_used_blocks, bm.num_usable_blocks
        self.blocks_used.set(used)
        self.blocks_free.set(bm.num_free_blocks)
        self.blocks_total.set(total)
        self.blocks_touched.set(bm.num_touched)
        self.blocks_peak_used.set(bm.peak_used)
        self.kv_usage.set(used / total if total else 0.0)
        # The block manager keeps this count as blocks gain and lose content: O(1), every step.
        self.blocks_cached.set(bm.num_cached_blocks)
        self.prefix_hit_rate.set(bm.stats.hit_rate)
        pre = sched.num_preemptions
        if pre > self._preempt_seen:
            self.preemptions.inc(pre - self._preempt_seen)
            self._preempt_seen = pre

        spec = engine.spec
        if spec is not None:
            st = spec.stats
            seen_p, seen_a = self._spec_seen
            if st.proposed > seen_p:
                self.spec_proposed.inc(st.proposed - seen_p)
            if st.accepted > seen_a:
                self.spec_accepted.inc(st.accepted - seen_a)
            self._spec_seen = (st.proposed, st.accepted)
            self.spec_acceptance.set(st.acceptance_rate)
            self.spec_mean_len.set(st.mean_accepted_length)

    def on_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens.inc(num_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
