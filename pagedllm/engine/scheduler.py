"""Decides, each step, which sequences run and how many tokens each computes.

Continuous batching with chunked prefill: running sequences (decodes and
unfinished prefills) go first, in admission order, then waiting ones are
admitted while the token budget, the sequence cap and free blocks allow.
When blocks run out the most recently admitted sequence is preempted: its
blocks are freed and it goes back to the front of the queue to be recomputed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Callable

from ..config import SchedulerConfig
from .block_manager import BlockManager
from .pacing import PrefillPacer
from .sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


# A pipeline's prompt chunk of several sequences' prompts (`schedule_micro_batch`): small
# enough that the pipeline's fill and drain (a stage waiting for the first chunk, another for
# the last) stay short beside a long prefill, large enough that a chunk's products still run
# at the kernels' wide rate.
PIPELINE_CHUNK = 256


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # query tokens this step, proposals included
    # Speculative proposals verified after the sequence's last token (seq.spec_tokens).
    spec_tokens: list[int] = field(default_factory=list)
    # A chunk of the prompt of a request that asked for prompt_logprobs: it keeps the logits
    # of the positions it scores (score_range), beside the row it samples from.
    scores: bool = False
    # A chunk with image placeholder tokens: the images it holds tokens of (the runner puts their
    # embeddings in, encoding those not cached). Empty for every other chunk.
    images: list | tuple = ()

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so it yields a token (a
        scoring-only request's prompt yields none)."""
        return (
            self.seq.num_computed_tokens + self.num_new_tokens - len(self.spec_tokens) == self.seq.num_tokens
            and not self.seq.scoring_only
        )

    def ran(self) -> None:
        """The chunk's forward ran: the K/V of its tokens are in the cache."""
        self.seq.num_computed_tokens += self.num_new_tokens

    def score_range(self) -> tuple[int, int]:
        """The positions [lo, hi) of this chunk whose logits score the prompt: those not scored
        yet (a recompute after preemption skips what it scored before), before the prompt's last
        token, which predicts nothing of the prompt (Sequence.score_end)."""
        seq = self.seq
        start = seq.num_computed_tokens
        lo = max(start, seq.num_scored)
        hi = min(start + self.num_new_tokens, seq.score_end)
        return lo, max(lo, hi)

    def pool_range(self) -> tuple[int, int]:
        """The positions [lo, hi) of this chunk whose final hidden states a pooling request keeps:
        the last token's, the first's (CLS) or all (mean), less those pooled already."""
        seq = self.seq
        start = seq.num_computed_tokens
        mode, n = seq.pooling.mode, seq.num_tokens
        want_lo, want_hi = (n - 1, n) if mode == "last" else (0, 1) if mode == "cls" else (0, n)
        lo = max(start, seq.num_pooled, want_lo)
        hi = min(start + self.num_new_tokens, want_hi)
        return lo, max(lo, hi)

    @property
    def is_decode(self) -> bool:
        """One real token (plus proposals): runs as decode rows over the cache."""
        return self.num_new_tokens - len(self.spec_tokens) == 1


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    has_images: bool = False  # some chunk holds image tokens (ScheduledSeq.images)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        encoder_cache=None,
        on_preempt: Callable[[Sequence], None] | None = None,
    ) -> None:
        """`encoder_cache`: a vision-language model's EncoderCache (pagedllm/multimodal), the
        runner's, which says what is encoded already; None for text-only models.
        `on_preempt`: called with each preempted sequence once its blocks are freed: a draft model
        gives back its blocks of the same pool (engine/draft.py), so the next room check counts them."""
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.on_preempt = on_preempt
        self.encoder_cache = encoder_cache
        # The image tokens the step may encode at most (0 for text-only models).
        self.encoder_budget = config.encoder_budget if encoder_cache is not None else 0
        # Prompt tokens beside decoding sequences (pacing.py); None: prompts take the whole budget.
        self.pacer = PrefillPacer(config.decode_latency_factor) if config.decode_latency_factor else None

    # -- queue ------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- the decision -----------------------------------------------------
    def schedule(self, cap: int | None = None, held: int = 0, tokens: int | None = None) -> SchedulerOutput:
        """The step's work. `cap`: the most sequences it schedules (None: no cap; forked n > 1
        siblings may run past max_num_seqs); `held`: running sequences set aside from `running`
        meanwhile (`schedule_disjoint`), which count against max_num_seqs; `tokens`: a token
        budget below max_num_batched_tokens."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if tokens is not None:
            budget = max(1, min(budget, tokens))
        cap = _NO_CAP if cap is None else cap
        self._encoding: set[str] = set()  # images this step encodes (charged once)
        self._enc_left = self.encoder_budget
        vision = self.encoder_cache is not None  # a text-only model never looks at seq.mm
        # Prompts are shared (shortest first, paced beside decodes) where the pacer is on: a
        # server's streams. Pipeline micro-batches (`tokens`) split prompts their own way.
        paced = self.pacer is not None and tokens is None
        shares, admit = self._prompt_shares(budget, cap, held) if paced else (None, budget)
        left = self._schedule_running(out, budget, vision, cap, shares)
        if not out.preempted:
            self._admit_waiting(out, left if shares is None else min(left, admit), vision, cap, held)
        if not out and shares is not None:
            # The shares went to waiting prompts that could not be admitted (no LoRA slot, no
            # blocks): the running prompts take the budget as they did before the sharing.
            self._schedule_running(out, budget, vision, cap, None)
        return out

    def _prompt_shares(self, budget: int, cap: int, held: int) -> tuple[dict[int, int], int]:
        """The step's prompt tokens shared among the prompts being computed and those waiting to
        be admitted: decodes first (their tokens are reserved), then the shortest prompts, so a
        short request beside a long prefill is not queued behind all of it; while anyone
        decodes, the prompts take at most what the pacer allows. Returns each running prompt's
        tokens by seq_id, and the tokens left for admissions. (A waiting prompt counts whole:
        what the prefix cache holds of it is only known once it is matched, at admission.)"""
        decoding, prompts = 0, []
        for s in self.running:
            if s.num_uncomputed_tokens == 1:
                decoding += 1 + len(s.spec_tokens)
            else:
                prompts.append((s.num_uncomputed_tokens, 0, s.seq_id))
        slots = min(self.config.max_num_seqs - len(self.running) - held, cap - len(self.running))
        prompts += [(s.num_uncomputed_tokens, 1, s.seq_id) for s in islice(self.waiting, max(0, slots))]
        left = max(0, budget - decoding)
        if decoding:
            left = min(left, self.pacer.prompt_budget())
        shares, admit = {}, 0
        for need, waiting, seq_id in sorted(prompts):
            n = min(need, left)
            left -= n
            if waiting:
                admit += n
            else:
                shares[seq_id] = n
        return shares, admit

    def observe(self, out: SchedulerOutput, seconds: float) -> None:
        """The step `out` ran in `seconds`: what the pacer steers by."""
        if self.pacer is not None:
            decodes = sum(1 for it in out.scheduled if it.is_decode)
            prompt = sum(it.num_new_tokens for it in out.scheduled if not it.is_decode)
            self.pacer.observe(decodes, prompt, seconds)

    def schedule_disjoint(self, busy: set[int], cap: int, tokens: int | None = None) -> SchedulerOutput:
        """A step beside steps still in flight (pipeline parallelism's micro-batches): the
        sequences of `busy` (seq ids) are neither scheduled nor preempted, their blocks untouched,
        until their step returns; at most `cap` sequences and `tokens` tokens run in this one,
        so the work splits among the steps in flight. The running order (admission order, which
        picks whom to preempt) is kept."""
        every = self.running
        self.running = [s for s in every if s.seq_id not in busy]
        if len(self.running) == len(every):
            return self.schedule(cap, tokens=tokens)
        order = {s.seq_id: i for i, s in enumerate(every)}
        try:
            return self.schedule(cap, held=len(every) - len(self.running), tokens=tokens)
        finally:  # the busy sequences back in their places; those admitted now after all
            self.running = sorted(
                [s for s in every if s.seq_id in busy] + self.running, key=lambda s: order.get(s.seq_id, len(every))
            )

    def schedule_micro_batch(
        self, busy: set[int], places: int, micro_batches: int, pair_with: int = 0
    ) -> SchedulerOutput:
        """One of `micro_batches` steps kept in flight (pipeline parallelism), beside those of
        `busy`, with `places` places in flight still free, this one's included: at most its
        share of the running and waiting sequences, and of the prompt tokens left, besides its
        sequences' decodes. Each stage works on one step while the next stage works on the step
        before, so steps side by side should weigh alike: a prompt cut at the token budget
        would end in a short chunk beside a full one, and a stage would wait behind it. So a
        step takes as many prompt tokens as the newest step in flight (`pair_with`), or, where
        that one had none, an equal share of the prompts left, cut into a multiple of
        `micro_batches` parts when no step is in flight. Prompts of several sequences are cut
        into chunks of about PIPELINE_CHUNK tokens even within the budget: the later stages
        wait for the first chunk and the first for the last, so the smaller they are, the
        shorter the pipeline's fill and drain (one sequence's prompt is not cut further: its
        chunks could only follow one another)."""
        cap = max(1, -(-(self.num_running + self.num_waiting) // micro_batches))
        prompt, decode, prompts = self.tokens_to_compute(busy)
        share = pair_with
        if not share:
            steps = max(-(-prompt // self.config.max_num_batched_tokens), min(prompts, -(-prompt // PIPELINE_CHUNK)))
            if places == micro_batches:  # in pairs, where there are prompts enough to pair
                parts = min(-(-steps // micro_batches) * micro_batches, max(steps, prompts))
            else:
                parts = max(places, steps)
            share = -(-prompt // max(1, parts))
        return self.schedule_disjoint(busy, cap, max(1, decode + share))

    def tokens_to_compute(self, busy: set[int]) -> tuple[int, int, int]:
        """(prompt tokens, decode tokens, sequences with prompt tokens) of the sequences not in
        `busy`, if each ran whole: what is left of their prompts; a decode's token and its
        proposals."""
        prompt = decode = prompts = 0
        for s in self.running:
            if s.seq_id not in busy:
                if s.num_uncomputed_tokens == 1:
                    decode += 1 + len(s.spec_tokens)
                else:
                    prompt += s.num_uncomputed_tokens
                    prompts += 1
        return prompt + sum(s.num_uncomputed_tokens for s in self.waiting), decode, prompts + len(self.waiting)

    def _schedule_running(
        self, out: SchedulerOutput, budget: int, vision: bool, cap: int, shares: dict[int, int] | None
    ) -> int:
        """The running sequences' next tokens (proposals to verify, a decode, a prefill chunk),
        in order, preempting from the back when blocks run short; the budget left. `shares`: the
        prompt tokens each prompt may take (_prompt_shares), None: what the budget leaves."""
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < cap:
            seq = self.running[i]
            spec = self._spec_fits(seq, budget)
            if spec:
                n = 1 + len(spec)
            elif shares is not None and seq.num_uncomputed_tokens > 1:
                n = _chunk(seq, min(budget, shares.get(seq.seq_id, 0)))
                if n == 0:  # no share this step: a shorter prompt or the decodes took it
                    i += 1
                    continue
            else:
                n = _chunk(seq, budget)
            images = None
            if vision and seq.mm is not None and not spec:
                n, images = self._image_chunk(seq, n)
                if n == 0:  # its next image does not fit this step: it waits, keeping its blocks
                    i += 1
                    continue
            if not self._make_room(seq, n, out):
                break  # seq itself was preempted; everything after it already was
            self._grow(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n, spec, _scores(seq)))
            if images:
                self._charge(out, images)
            budget -= n
            i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int, vision: bool, cap: int, held: int) -> None:
        """Waiting sequences admitted in arrival order while the budget, the sequence limit, the
        blocks and the LoRA slots allow (after their cached prefix)."""
        # LoRA: the running sequences use at most max_loras adapters (the slots they run from).
        loras = {s.lora_id for s in self.running if s.lora_id} if self.config.max_loras else None
        while (
            self.waiting
            and budget > 0
            and len(self.running) + held < self.config.max_num_seqs
            and len(out.scheduled) < cap
        ):
            seq = self.waiting[0]
            if loras is not None and seq.lora_id and seq.lora_id not in loras:
                if len(loras) >= self.config.max_loras:
                    break  # its adapter waits for a slot, in arrival order
                loras.add(seq.lora_id)
            # A prompt still to be scored or pooled computes every position: its outputs are wanted.
            scoring = seq.computes_whole_prompt
            if not scoring:
                self.bm.match_prefix(seq)
            n = _chunk(seq, budget)
            images = None
            if vision and seq.mm is not None:
                n, images = self._image_chunk(seq, n)
            self.release_window(seq)
            if n == 0 or not self.bm.can_grow(seq, seq.num_computed_tokens + n):
                self.bm.free(seq, "keep")  # give back what the prefix match took
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            if not scoring:
                self.bm.record_admission(seq)
            self._grow(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, scores=_scores(seq)))
            if images:
                self._charge(out, images)
            budget -= n

    def _image_chunk(self, seq: Sequence, n: int) -> tuple[int, list]:
        """seq's chunk of n tokens cut where images demand, and the images it holds tokens of.
        An image the encoder cache lacks must be encoded whole this step, within what is left
        of the encoder budget, or the chunk stops before it. Under bidirectional image attention
        (Gemma 3) a chunk never ends inside an image: it stops before the image, or, starting in
        it (or at it), takes it to its end or waits (n = 0)."""
        mm, start = seq.mm, seq.num_computed_tokens
        end = start + n
        left = self._enc_left
        images = []
        for im in mm.overlapping(start, end):
            cut = None
            if im.hash not in self.encoder_cache and im.hash not in self._encoding:
                if im.num_embeds > left:
                    cut = im.offset
                else:
                    left -= im.num_embeds
            if cut is None and mm.bidirectional and end < im.end:
                cut = im.offset
            if cut is not None:
                end = cut if cut > start else start
                break
            images.append(im)
        return end - start, images

    def _charge(self, out: SchedulerOutput, images: list) -> None:
        """The chunk just scheduled holds these images' tokens: those not cached are encoded
        this step, from the encoder budget."""
        out.scheduled[-1].images = images
        out.has_images = True
        for im in images:
            if im.hash not in self.encoder_cache and im.hash not in self._encoding:
                self._encoding.add(im.hash)
                self._enc_left -= im.num_embeds

    def _spec_fits(self, seq: Sequence, budget: int) -> list[int]:
        """seq's proposals, when they fit the token budget and the free blocks as they are:
        speculation never preempts anyone."""
        spec, seq.spec_tokens = seq.spec_tokens, []
        if not spec or seq.num_uncomputed_tokens != 1 or 1 + len(spec) > budget:
            return []
        self.release_window(seq)
        return spec if self.bm.can_grow(seq, seq.num_tokens + len(spec)) else []

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until `seq` can grow by n tokens."""
        self.release_window(seq)
        while not self.bm.can_grow(seq, seq.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _grow(self, seq: Sequence, n: int) -> None:
        self.bm.grow(seq, seq.num_computed_tokens + n)

    def release_window(self, seq: Sequence) -> None:
        """Sliding groups give back the blocks behind their window (kv/groups.py)."""
        if seq.block_table:
            self.bm.release_window(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.spec_tokens = []
        self.bm.free(seq, "keep")  # its blocks stay cached: the recompute may hit them
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        if self.on_preempt is not None:
            self.on_preempt(seq)
        logger.debug("preempted %s (%d tokens) to free KV blocks", seq.request_id, seq.num_tokens)

    # -- after the step ---------------------------------------------------
    def update(self, out: SchedulerOutput) -> None:
        """The step's forward ran: every chunk's tokens are computed and full blocks get their
        hashes. A verification counts its sequence's own token only: the proposals' slots
        count once they are accepted (verified)."""
        for it in out.scheduled:
            if it.spec_tokens:
                it.seq.num_computed_tokens += 1
                continue
            it.ran()
            self.bm.commit_full_blocks(it.seq)

    def verified(self, seq: Sequence) -> None:
        """seq appended its accepted proposals and the step's own token: their K/V are computed
        but the last token's (computed next step); the rejected proposals' slots go back."""
        self.bm.rewind(seq, seq.num_tokens - 1)
        self.bm.commit_full_blocks(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """An n > 1 sibling takes its parent's computed prompt (its blocks, copy-on-write) and runs."""
        self.bm.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        self.add_running(child)

    def add_running(self, seq: Sequence) -> None:
        """A forked sibling joins the running set directly (its blocks are shared)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, keep_prefix: bool = True) -> None:
        """Remove a sequence from the queues and return its blocks; a normally finished
        sequence stays cached as a reusable prefix."""
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq, "retain" if keep_prefix else "drop")


_NO_CAP = 1 << 62  # schedule() without a cap on its sequences


def _scores(seq: Sequence) -> bool:
    """seq's chunk this step lies in the prompt of a request that asked for prompt_logprobs."""
    return seq.prompt_scores is not None and seq.num_computed_tokens < seq.num_prompt_tokens


def _chunk(seq: Sequence, budget: int) -> int:
    """The tokens seq computes this step: what is left, within the step's budget and the
    sequence's own cap (a scoring request's chunk_size)."""
    n = min(seq.num_uncomputed_tokens, budget)
    return n if seq.max_chunk is None else min(n, seq.max_chunk)
