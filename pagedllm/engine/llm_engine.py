"""The engine loop: admit requests, schedule, run, update, then output processing.

Each step has vLLM v1's shape: Scheduler.schedule() decides, ModelRunner executes, the
scheduler's update records what ran, then the engine records the step's results (prompt
scores, pooled rows, sampled and accepted tokens) and the output processor makes the
outputs. Text, stop strings, logprob entries and request metrics are the output processor's
(output_processor.py); callers drive the loop through the driver (driver.py); the parts are
assembled from the config by factory.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from ..config import CacheConfig, SchedulerConfig
from ..device import KEEP_BUFFERS_BYTES, keep_freed_buffers, release_freed_memory
from ..attention.backend import AttentionBackend
from .admission import RequestChecks
from ..kv.cache import CachePlan, KVCacheSpec
from ..kv.groups import KVGroups
from ..kv.trace import committed_bytes
from ..loading.loader import LoadedModel
from ..lora.manager import LoRAManager
from ..multimodal import EncoderCache, MultiModalInput
from ..outputs import RequestOutput
from ..sampling.params import SamplingParams
from ..speculative import decoder as spec_decoder
from ..structured.grammar import GrammarEngine, advance as grammar_advance
from .block_manager import BlockManager
from .model_runner import ModelRunner, RunnerOutput
from .output_processor import OutputProcessor
from .pooling import PoolingConfig, check_pooling_input, pool_rows, pooled_vector
from .request import Request
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class KVParts:
    """The engine's KV cache: its groups, spec and size plan (kv/spec.py), the paged cache (None
    for the contiguous backend) and the attention backend over it (attention/build.py), and
    whether prefix caching really runs, with why (not)."""

    groups: KVGroups
    spec: KVCacheSpec
    plan: CachePlan
    cache: Any  # a kv.cache.KVCache, or None for the contiguous backend
    backend: AttentionBackend
    prefix_caching: bool
    prefix_caching_note: str


class LLMEngine:
    """The engine's parts, whole when they come (engine/factory.py assembles them from the
    config), and the loop over them."""

    def __init__(
        self,
        loaded: LoadedModel,
        cache_cfg: CacheConfig,
        sched_cfg: SchedulerConfig,
        device: torch.device,
        dtype: torch.dtype,
        *,
        kv: KVParts,
        block_manager: BlockManager,
        scheduler: Scheduler,
        runner: ModelRunner,
        output: OutputProcessor,
        structured: GrammarEngine,
        lora: LoRAManager | None,
        encoder_cache: EncoderCache | None,
        spec: spec_decoder.SpeculativeDecoder | None,
        executor=None,
    ) -> None:
        """`executor`: rank 0's side of tensor or pipeline parallelism, or None. The runner
        never sees it: the engine puts it between the runner's plan and sample (`_execute`)."""
        self.model, self.model_config = loaded.model, loaded.config
        self.tokenizer = loaded.tokenizer
        self.weights = loaded.weights  # formats, resident bytes, kernel path (for the trace)
        src = loaded.source
        self.model_name = src.path.name if src.name == "default" else src.name  # for errors
        self.cache_config, self.sched_config = cache_cfg, sched_cfg
        self.device, self.dtype = device, dtype
        self.eos_token_ids = output.eos_token_ids
        self.kv_groups, self.kv_spec, self.cache_plan = kv.groups, kv.spec, kv.plan
        self.kv_cache, self.backend = kv.cache, kv.backend
        self.prefix_caching, self.prefix_caching_note = kv.prefix_caching, kv.prefix_caching_note
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.runner = runner
        self.output = output  # text, stop strings, logprob entries, metrics
        self.structured = structured  # llguidance's token trie is built on the first constrained request
        self.lora = lora
        self.encoder_cache = encoder_cache  # image embeddings by content hash (pagedllm/multimodal)
        self.spec = spec  # speculative decoding (None: off)
        self.executor = executor
        # Pipeline parallelism keeps a step a stage in flight (micro-batches of disjoint
        # sequences, `_step_pipelined`); one rank, or tensor parallelism, runs a step at a time.
        self.micro_batches = executor.micro_batches if executor is not None else 1
        self.in_flight: deque[tuple[SchedulerOutput, Any]] = deque()  # (step, runner's PendingStep)
        self.busy: set[int] = set()  # seq ids of the steps in flight
        self.aborted_in_flight: list[Sequence] = []  # aborted while in flight: ended as their step returns
        self.max_in_flight = 0  # the most steps in flight at once so far
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.checks = RequestChecks(self)  # what each request is checked against as it arrives
        self.stats = {"prompt_tokens": 0, "generated_tokens": 0, "steps": 0}
        # Running share of allocated-but-empty token slots, for the trace.
        self.waste_sum, self.waste_steps = 0.0, 0
        committed, how = committed_bytes(self)
        logger.info("%s; committed now %.1f MB (%s)", self.cache_plan.describe(self.kv_spec), committed / 2**20, how)
        release_freed_memory()  # what loading freed, before the KV cache starts to fill
        if device.type == "cpu" and keep_freed_buffers():  # steps reuse their large buffers
            logger.debug("the heap keeps freed blocks up to %d MB for reuse", KEEP_BUFFERS_BYTES >> 20)

    # -- requests ---------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int] | MultiModalInput | None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        lora_request=None,
    ) -> str:
        """`lora_request`: a LoRARequest (pagedllm/lora) whose adapter this request runs with.
        `prompt` may be a MultiModalInput (pagedllm/multimodal): token ids with images."""
        params = params or SamplingParams()
        params.validate()
        mm = None
        if isinstance(prompt, MultiModalInput):
            mm = self.checks.images(prompt)
            prompt, prompt_token_ids = mm.prompt, mm.prompt_token_ids
        self.checks.can_generate(lora_request)
        text = prompt if isinstance(prompt, str) else None
        prompt_token_ids = self.checks.prompt_ids(prompt, prompt_token_ids, params, mm)
        if mm is not None and not mm.images:
            mm = None  # a prompt without images runs as text
        rid = self._new_request_id(request_id)
        matchers = self.structured.matchers(params.structured, params.n) if params.structured else [None] * params.n
        seqs = []
        for i in range(params.n):
            seqs.append(
                Sequence(
                    rid, prompt_token_ids, params, prompt=text, index=i, grammar=matchers[i], lora=lora_request, mm=mm
                )
            )
        # n > 1: the prompt is computed once by the first sequence; the others fork from it
        # when it samples, sharing its blocks copy-on-write.
        seqs[0].fork_children = seqs[1:]
        metrics, states = self.output.start(prompt_token_ids, params)
        req = Request(rid, text, prompt_token_ids, params, seqs, metrics, states)
        if params.prompt_logprobs is not None:
            # Scored by its own prefill, chunk by chunk beside the step's other work; the
            # entries are complete when the prefill is, before its first output.
            seqs[0].prompt_scores = [None]
        self.requests[rid] = req
        self.stats["prompt_tokens"] += len(prompt_token_ids)
        if params.max_tokens == 0:  # scoring only: the first sequence scores, nothing is generated
            for s in seqs[1:]:
                s.status, s.finish_reason = SequenceStatus.FINISHED, "length"
            seqs[0].fork_children = []
        self.scheduler.add(seqs[0])
        return rid

    def _score_prompt(self, seq: Sequence, first: int, logits: torch.Tensor) -> None:
        """vLLM's prompt_logprobs, for the positions first.. of a scoring chunk: each next prompt
        token's logprob and the k most likely tokens' at that place. The request gets the entries
        once its whole prompt is scored. (The engine's own prompt_logits requests keep the rows.)"""
        if seq.score_kind == "logits":  # the engine's own prompt_logits: the whole rows
            seq.prompt_scores.extend(logits.float().cpu().unbind(0))
            return
        k = seq.params.prompt_logprobs
        ids = seq.prompt_token_ids
        lsm = torch.log_softmax(logits.float(), dim=-1)
        n = lsm.shape[0]
        tgt = torch.tensor(ids[first + 1 : first + 1 + n], device=lsm.device)
        chosen = lsm.gather(1, tgt[:, None])[:, 0].tolist()
        tv, ti = lsm.topk(k, dim=-1) if k > 0 else (None, None)
        for j in range(n):
            entry = dict(zip(ti[j].tolist(), tv[j].tolist())) if k > 0 else {}
            entry[ids[first + 1 + j]] = chosen[j]
            seq.prompt_scores.append(entry)
        req = self.requests.get(seq.request_id)
        if req is not None and not seq.scoring_prompt:
            req.prompt_logprobs = seq.prompt_scores

    def abort(self, request_id: str) -> bool:
        """End the request now; a sequence in a step still in flight (pipeline parallelism) keeps
        its blocks and rows until that step returns, and is ended then."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for s in req.seqs:
            if not s.is_finished:
                s.finish_reason = "abort"
                s.fork_children = []
                if self.busy and s.seq_id in self.busy:
                    self.aborted_in_flight.append(s)
                else:
                    self._finish(s)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def add_scoring_request(
        self, token_ids: list[int], keep: str, max_chunk: int | None = None, lora_request=None
    ) -> Sequence:
        """One of the engine's own scoring requests (engine/scoring.py runs them through the
        driver): its prompt is scored by its prefill, at most `max_chunk` tokens a step (None: the
        step's budget), each position keeping `keep` (Sequence.score_kind: "logits", "logprob",
        "logprob_top1") in the sequence's prompt_scores. Nothing is generated, and its blocks are
        dropped, not kept as a prefix, once it is done. Returns its sequence."""
        if keep not in ("logits", "logprob", "logprob_top1"):
            raise ValueError(f"internal: unknown scoring kind {keep!r}")
        if max_chunk is not None and (not isinstance(max_chunk, int) or max_chunk < 1):
            raise ValueError(f"chunk_size must be a positive integer (tokens per step) or None, got {max_chunk!r}")
        prompt = token_ids if isinstance(token_ids, MultiModalInput) else list(token_ids)
        if isinstance(prompt, MultiModalInput) and prompt.bidirectional and max_chunk is not None:
            longest = max((im.length for im in prompt.images), default=0)
            if max_chunk < longest:
                raise ValueError(
                    f"chunk_size={max_chunk} is shorter than an image ({longest} tokens), which "
                    "this model must prefill in one chunk; use chunk_size >= that, or None"
                )
        rid = self.add_request(prompt, SamplingParams(max_tokens=0, prompt_logprobs=0), lora_request=lora_request)
        seq = self.requests[rid].seqs[0]
        seq.score_kind, seq.max_chunk = keep, max_chunk
        seq.prompt_scores = [] if keep == "logits" else [None]
        return seq

    def add_pooling_request(self, token_ids: list[int], pooling: PoolingConfig, request_id: str | None = None) -> str:
        """An embedding request (engine/pooling.py): its prompt is prefilled as scheduled work,
        chunked beside whatever else runs, and the final hidden states of the positions `pooling`
        names are pooled into one vector (the request output's `embedding`) as the chunks run.
        Nothing is generated, and its blocks are dropped, not kept as a prefix, once it is done."""
        if self.executor is not None:
            raise ValueError(
                "embeddings under tensor or pipeline parallelism are not supported; use "
                "tensor_parallel_size=1 and pipeline_parallel_size=1"
            )
        ids = check_pooling_input(token_ids, self.sched_config.max_model_len, self.model_config.vocab_size)
        blocks = self.block_manager.max_blocks(len(ids), self.sched_config.max_num_batched_tokens)
        if blocks > self.block_manager.num_usable_blocks:
            raise ValueError(
                f"an input of {len(ids)} tokens needs {blocks} KV blocks but the cache holds "
                f"{self.block_manager.num_usable_blocks}; shorten it, or give the KV cache more memory"
            )
        rid = self._new_request_id(request_id)
        params = SamplingParams(max_tokens=0, prompt_logprobs=0)  # the scoring-only params: nothing generated
        seq = Sequence(rid, ids, params, pooling=pooling, score_kind="pool")
        metrics, states = self.output.start(ids, params)
        self.requests[rid] = Request(rid, None, ids, params, [seq], metrics, states)
        self.stats["prompt_tokens"] += len(ids)
        self.scheduler.add(seq)
        return rid

    def _new_request_id(self, request_id: str | None) -> str:
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        return rid

    # -- the step ---------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One schedule, one execute, the scheduler's update, then the record (scores, pooled
        rows, tokens appended, proposals accepted), the sequences that the output processor finds
        at a stop string ended, the next step's proposals made from this step's tokens, and the
        outputs of every request the step touched."""
        if self.micro_batches > 1:
            return self._step_pipelined()
        sched = self.scheduler.schedule()
        self._drop_preempted(sched)
        if not sched:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress although requests are waiting")
            return []
        return self._record(sched, self._execute(sched))

    def _step_pipelined(self) -> list[RequestOutput]:
        """`step` under pipeline parallelism, as vLLM's batch queue (EngineCore's
        step_with_batch_queue): while fewer steps than stages are in flight, schedule one of
        sequences not in flight (the running set split among the stages) and launch it: its
        plan sent, the first stage run, its hidden states sent on. Once the queue is full, or
        nothing more can be scheduled, wait for the oldest step's logits and record it as
        `step` does. A step in flight holds its sequences: not scheduled again, not preempted,
        their blocks kept, until it returns."""
        q = self.in_flight
        if len(q) < self.micro_batches:
            sched = self._schedule_micro_batch()
            if sched:
                self._launch(sched)
                if len(q) < self.micro_batches:
                    return []  # the next step's turn to be scheduled, before waiting for this one
            elif not q:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("scheduler made no progress although requests are waiting")
                return []
        sched, pending = q.popleft()
        out = self.runner.sample(pending, self.executor.collect(), None)
        for it in sched.scheduled:
            self.busy.discard(it.seq.seq_id)
        ended = [s for s in self.aborted_in_flight if s.seq_id not in self.busy]
        if ended:
            sched, out = self._without_aborted(sched, out, ended)
        outs = self._record(sched, out)
        for s in ended:
            self.aborted_in_flight.remove(s)
            if not s.is_finished:
                self._finish(s)
        return outs

    def _schedule_micro_batch(self) -> SchedulerOutput:
        """A step of sequences not in flight, its share of the work (scheduler's
        `schedule_micro_batch`, paired with the newest step in flight), its preempted sequences
        dropped."""
        newest = self.in_flight[-1][0].scheduled if self.in_flight else ()
        sched = self.scheduler.schedule_micro_batch(
            self.busy,
            self.micro_batches - len(self.in_flight),
            self.micro_batches,
            sum(it.num_new_tokens for it in newest if not it.is_decode),
        )
        self._drop_preempted(sched)
        return sched

    @torch.inference_mode()
    def _launch(self, sched: SchedulerOutput) -> None:
        """Pipeline parallelism's micro-batch: its plan sent and the first stage run (the
        executor's `launch`); its logits come back by the executor's `collect` while later steps
        of other sequences are launched."""
        pending = self.runner.prepare_step(sched.scheduled)
        self.executor.launch(pending.plan, self.runner)
        self.stats["steps"] += 1
        self.busy.update(it.seq.seq_id for it in sched.scheduled)
        self.in_flight.append((sched, pending))
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))

    @staticmethod
    def _without_aborted(
        sched: SchedulerOutput, out: RunnerOutput | None, ended: list[Sequence]
    ) -> tuple[SchedulerOutput, RunnerOutput | None]:
        """The returned step less the sequences aborted while it was in flight: nothing of
        theirs is recorded (their requests are gone)."""
        gone = {s.seq_id for s in ended}
        kept = SchedulerOutput(
            [it for it in sched.scheduled if it.seq.seq_id not in gone], sched.preempted, sched.has_images
        )
        if out is None:
            return kept, None
        keep = [i for i, s in enumerate(out.seqs) if s.seq_id not in gone]
        sampled = out.sampled
        if sampled is not None and len(keep) != len(out.seqs):
            sampled = type(sampled)(
                [sampled.token_ids[i] for i in keep],
                [sampled.logprobs[i] for i in keep] if sampled.logprobs else sampled.logprobs,
            )
        return kept, RunnerOutput(
            [out.seqs[i] for i in keep],
            sampled,
            [x for x in out.prompt_logits if x[0].seq_id not in gone],
            [x for x in out.next_token_scores if x[0].seq_id not in gone],
            [x for x in out.pooled if x[0].seq_id not in gone],
        )

    def _record(self, sched: SchedulerOutput, out: RunnerOutput | None) -> list[RequestOutput]:
        """The step's results, after its forward: see `step`."""
        if out is not None:
            self._record_scores(out)
        verifying = {it.seq.seq_id: it.spec_tokens for it in sched.scheduled if it.spec_tokens}
        forking = [it.seq for it in sched.scheduled if it.seq.fork_children and it.samples]
        self.scheduler.update(sched)
        for seq in forking:
            self._fork(seq)
        touched: dict[str, Request] = {}
        self._finish_scored(sched, touched)
        self._track_waste()
        if out is not None and out.sampled is not None:
            accepted = self._record_samples(out, verifying, touched)
            self._end_at_stop_strings(touched, accepted)
        if self.spec is not None:
            # The next step's proposals, from the tokens this one added: n-gram lookup, or the
            # draft model's catch-up and proposal forwards, after sampling as vLLM's drafter runs.
            # (Sequences in flight get theirs when their step returns.)
            running = self.scheduler.running
            self.spec.propose([s for s in running if s.seq_id not in self.busy] if self.busy else running)
        return self._outputs(list(touched.values()))

    def _drop_preempted(self, sched: SchedulerOutput) -> None:
        """The preempted sequences' K/V and runner rows go (their draft blocks went back as they
        were preempted)."""
        for s in sched.preempted:
            self.backend.free_seq(s.seq_id)
            self.runner.release(s.seq_id)

    def _execute(self, sched: SchedulerOutput) -> RunnerOutput | None:
        """The forward; a step of decode rows only also tells speculation what a step costs."""
        t0 = time.perf_counter()
        if self.executor is None:
            out = self.runner.execute(sched.scheduled, sched.has_images)
        else:
            with torch.inference_mode():
                step = self.runner.prepare_step(sched.scheduled, sched.has_images)
                out = self.runner.sample(step, *self.executor.forward(step.plan, self.runner))
        seconds = time.perf_counter() - t0
        self.scheduler.observe(sched, seconds)
        if self.spec is not None and all(it.is_decode for it in sched.scheduled):
            self.spec.observe_step(sum(it.num_new_tokens for it in sched.scheduled), seconds)
        self.stats["steps"] += 1
        return out

    def _record_scores(self, out: RunnerOutput) -> None:
        """Prompt scoring (prompt_logprobs and the engine's own scoring requests) and pooling."""
        for seq, first, logits in out.prompt_logits:
            self._score_prompt(seq, first, logits)
        for seq, _, values in out.next_token_scores:
            seq.prompt_scores.extend(values)  # already reduced by the runner, in order
        for seq, first, rows in out.pooled:
            pool_rows(seq, first, rows)

    def _finish_scored(self, sched: SchedulerOutput, touched: dict[str, Request]) -> None:
        """Scoring-only sequences whose prompt is now scored (or pooled): their request is done."""
        for it in sched.scheduled:
            if it.seq.scoring_only and it.seq.num_computed_tokens == it.seq.num_tokens:
                req = self.requests.get(it.seq.request_id)
                if req is not None and it.seq.pooling is not None:
                    req.embedding = pooled_vector(it.seq)
                it.seq.finish_reason = "length"
                self._finish(it.seq)
                if req is not None:
                    touched[req.request_id] = req

    def _record_samples(
        self, out: RunnerOutput, verifying: dict[int, list[int]], touched: dict[str, Request]
    ) -> list[Sequence]:
        """Each sampled row's token appended; a verified sequence's rows accepted together.
        Returns the sequences that accepted proposals, still running: their K/V is rolled back
        to their tokens once stop strings have had their say."""
        seqs, sampled = out.seqs, out.sampled
        accepted = []
        row = 0
        while row < len(seqs):
            seq = seqs[row]
            drafts = verifying.get(seq.seq_id)
            m = 1 if drafts is None else len(drafts) + 1
            toks = sampled.token_ids[row : row + m]
            lps = sampled.logprobs[row : row + m] if sampled.logprobs else [None] * m
            if min(toks) < 0:  # the sampler marks rows whose logits were not finite
                self._fail(seq)
            elif drafts is None:
                self._append(seq, toks[0], lps[0])
            elif self._accept(seq, drafts, toks, lps):
                accepted.append(seq)
            row += m
            req = self.requests.get(seq.request_id)
            if req is not None:
                touched[req.request_id] = req
        return accepted

    def _end_at_stop_strings(self, touched: dict[str, Request], accepted: list[Sequence]) -> None:
        """The output processor's stop-string hits end their sequences (vLLM v1's abort from
        the output processor), tokens past the stop dropped; then the verified sequences still
        running keep the K/V of their accepted tokens."""
        for seq, keep, stop in self.output.find_stops(touched.values()):
            self.stats["generated_tokens"] -= seq.truncate_output(keep)
            seq.finish_reason, seq.stop_reason = "stop", stop
            if not seq.is_finished:
                self._finish(seq)
        for seq in accepted:
            if not seq.is_finished:
                self.scheduler.verified(seq)

    def _outputs(self, reqs: list[Request]) -> list[RequestOutput]:
        """The step's outputs, built by the output processor; finished requests leave the engine."""
        outs = [self.output.make_output(r) for r in reqs]
        for o in outs:
            if o.finished:
                self.requests.pop(o.request_id, None)
        return outs

    def _accept(self, seq: Sequence, drafts: list[int], toks: list[int], lps: list) -> bool:
        """Append the accepted proposals and the step's own token; whether the sequence still
        runs (then its K/V is rolled back to them after the stop strings are looked at)."""
        a = spec_decoder.accepted_length(drafts, toks)
        self.spec.record(seq, len(drafts), a)
        for i, tok in enumerate(drafts[:a] + [toks[a]]):
            self._append(seq, tok, lps[i])
            if seq.is_finished:
                return False  # its blocks are already returned
        return True

    def _track_waste(self) -> None:
        """Allocated slots not holding a token, over the running sequences' tables: entries
        minus the null ones a window released (counted by the block manager as it nulls them),
        against computed tokens (a prompt prefilled in chunks has blocks for its chunks so far)."""
        bs = self.cache_config.block_size
        running = self.scheduler.running
        if not running:
            return
        groups = self.block_manager.num_groups
        entries = sum(len(s.block_table) for s in running)
        if groups > 1:
            entries += sum(len(t) for s in running for t in s.group_tables)
        released = sum(s.num_released for s in running)
        alloc = (entries - released) * bs
        held = groups * sum(s.num_computed_tokens for s in running) - released * bs
        if alloc:
            self.waste_sum += max(0.0, 1 - held / alloc)
            self.waste_steps += 1

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers or pipeline stages (nothing to do on one rank)."""
        if self.executor is not None:
            self.executor.shutdown()

    def kv_cache_trace(self):
        from ..kv.trace import build_trace

        return build_trace(self)

    def _fork(self, parent: Sequence) -> None:
        for child in parent.fork_children:
            self.scheduler.fork(parent, child)
            self.backend.fork_seq(parent.seq_id, child.seq_id)
        parent.fork_children = []

    def _append(self, seq: Sequence, tok: int, lp) -> None:
        req = self.requests[seq.request_id]
        seq.append_token(tok)
        self.stats["generated_tokens"] += 1
        self.output.on_token(req, seq, tok, lp)
        p = seq.params
        is_eos = tok in self.eos_token_ids and not p.ignore_eos
        grammar_done = seq.grammar is not None and not is_eos and grammar_advance(seq.grammar, tok)
        if is_eos:
            seq.finish_reason, seq.stop_reason = "stop", None
        elif tok in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", tok
        elif grammar_done:  # the grammar is complete: nothing but EOS could follow
            seq.finish_reason, seq.stop_reason = "stop", None
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.sched_config.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self._finish(seq)

    def _fail(self, seq: Sequence) -> None:
        """End a sequence whose logits were not finite; its request fails, the batch goes on.
        Its blocks are dropped, not kept as a prefix: their K/V may hold the same NaN."""
        req = self.requests[seq.request_id]
        if req.error is None:
            req.error = (
                f"model {self.model_name!r} produced non-finite logits (NaN or inf) for "
                f"request {req.request_id!r} at engine step {self.stats['steps']} (output "
                f"token {seq.num_output_tokens + 1}); the weights or the activations hold "
                "NaN/inf, so this request failed; check the model file"
            )
            logger.error(req.error)
        seq.finish_reason = "error"
        seq.fork_children = []
        self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        # The engine's own scoring requests leave nothing behind, not even a reusable prefix.
        keep = seq.finish_reason not in ("abort", "error") and seq.score_kind == "entries"
        self.scheduler.finish(seq, keep_prefix=keep)
        self.backend.free_seq(seq.seq_id)
        self.runner.release(seq.seq_id)
        self.runner.sampler.release(seq.seq_id)
        if self.spec is not None:
            self.spec.release(seq)
