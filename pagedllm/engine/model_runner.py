"""Turns a scheduled batch into tensors once, runs the model, samples.

Order in the flat batch: decodes first (one token each, attended in one
batched call), then prefill chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..attention.metadata import AttentionMetadata
from ..sampling.metadata import SamplingMetadata
from ..sampling.sampler import Sampler, SamplerOutput
from .host_upload import HostUpload, Ints
from .input_batch import InputBatch
from .scoring import KEEP_ROWS, next_token_scores
from .scheduler import ScheduledSeq
from .sequence import Sequence


@dataclass
class StepPlan:
    """One forward pass as int sequences (lists, or int64 arrays for the per-token and table
    parts): what rank 0 decides and, under tensor parallelism, sends to the other ranks
    (distributed/messages.py), so every rank builds the same tensors."""

    ids: list[int]
    pos: Ints
    query_start_loc: list[int]
    context_lens: list[int]
    num_decodes: int
    seq_ids: list[int]
    slots: Ints = field(default_factory=list)  # paged backends only
    tables: Ints = field(default_factory=list)  # [num_seqs * width], padded with 0
    width: int = 0
    # Rows of the flat batch to compute logits for; None: every row (scoring a chunk).
    logits_rows: list[int] | None = field(default_factory=list)
    # Rows whose final hidden states pooling requests keep (an embedding's positions).
    hidden_rows: list[int] = field(default_factory=list)
    # Every logits row is sampled greedily and only its argmax is read: a pipeline's last
    # stage then sends each row's largest logit and where it is instead of the row.
    argmax_only: bool = False
    # KV groups after the first (kv/groups.py: sliding layers beside global ones): their slot
    # mappings and flat tables. (Tensor parallelism runs single-group models and sends none.)
    group_slots: list[Ints] = field(default_factory=list)
    group_tables: list[Ints] = field(default_factory=list)
    group_widths: list[int] = field(default_factory=list)
    # LoRA: each token's adapter slot (-1: the base model); None when no row has an adapter.
    lora_slots: np.ndarray | None = None
    # Images (pagedllm/multimodal): (first row in the flat batch, image, first and end row of its
    # embeddings) per slice of an image among the step's tokens; and, under bidirectional image
    # attention, per prefill attention row the [start, end) positions of the images among its
    # queries. Empty for text-only steps (vision-language models do not run under tensor parallelism).
    images: list = field(default_factory=list)
    image_spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # M-RoPE (Qwen2.5-VL): the rope positions where some differ from `pos`, [3, T] where a
    # token's three streams differ (image tokens), else [T]; None: rotate by `pos`.
    rope_pos: np.ndarray | None = None

    @property
    def has_prompt(self) -> bool:
        """A prompt chunk among the step's items (a decode row has a seq id of its own, a chunk one)."""
        return self.num_decodes < len(self.seq_ids)


@dataclass
class RunnerOutput:
    """What one step computed: a token per sampling row, and prompt-scoring logits."""

    seqs: list[Sequence]  # the sequence of each sampled row
    sampled: SamplerOutput | None
    # (sequence, first position, logits [rows, vocab] of that position and the next ones): the
    # prompt positions a scoring chunk computed this step (prompt_logprobs).
    prompt_logits: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)
    # (sequence, first position, a value per position): the same for the engine's own next-token
    # scoring requests (Sequence.score_kind "logprob", "logprob_top1"), reduced in the step.
    next_token_scores: list[tuple[Sequence, int, list]] = field(default_factory=list)
    # (sequence, first position, final hidden states [rows, hidden] float32): the positions a
    # pooling request's chunk keeps (Sequence.pooling).
    pooled: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)


@dataclass
class PendingStep:
    """A step between its plan and its sampling: the plan, each sampling row's sequence, logits
    row and offset, the scoring and pooling rows, and the grammar masks being computed."""

    plan: StepPlan
    sampling_seqs: list[Sequence]
    rows: list[int]
    offsets: list[int]
    scoring: list
    pooling: list
    masks: object


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        backend,
        block_size: int,
        device: torch.device,
        sampler: Sampler | None,
        structured=None,
        lora=None,
        encoder_cache=None,
    ) -> None:
        """`structured`: the GrammarEngine of constrained requests (None: none run here).
        `lora`: a LoRAManager (pagedllm/lora) when adapters are enabled.
        `encoder_cache`: a vision-language model's EncoderCache (pagedllm/multimodal)."""
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.upload = HostUpload(device)
        self.structured = structured
        self.lora = lora
        self.encoder_cache = encoder_cache
        self.encoder_stats = {"images_encoded": 0, "encoder_s": 0.0}
        # M-RoPE models rotate image prompts by positions of their own (StepPlan.rope_pos); for
        # every other model the step's positions are the rope's, with no per-sequence look.
        self.mrope = model.mrope
        # Per-sequence rows kept between steps: block tables of every KV group (input_batch.py).
        self.batch = InputBatch(backend.num_groups)
        for i, attn in enumerate(model.attention_modules()):
            attn.attn = backend.layer(i, attn.window, attn.scale, attn.softcap)

    def plan(self, batch: list[ScheduledSeq], images: bool = False) -> StepPlan:
        """The step's inputs (under tensor parallelism rank 0 sends them to the other ranks). A
        decode with speculative proposals becomes one decode row per query token (its last token,
        then each proposal), each over the same block table with the context up to itself: the
        batched decode kernel then verifies the proposals, and each row's attention is computed
        exactly as a one-token decode at that place would be.

        Python touches each sequence once (its token ids, and its row of the persistent batch,
        updated by what changed); positions, slots and block tables are array operations."""
        paged = self.backend.uses_block_tables
        if not images and all(it.num_new_tokens == 1 and not it.scores and it.seq.pooling is None for it in batch):
            return self._plan_one_token_each(batch, paged)
        return self._plan_rows(batch, images, paged)

    def _plan_rows(self, batch: list[ScheduledSeq], images: bool, paged: bool) -> StepPlan:
        """`plan` for any step: each item's tokens, attention rows, logits and hidden rows and
        image slices gathered in one pass, then `_plan_arrays`."""
        ids: list[int] = []
        seq_ids: list[int] = []  # one per attention row (a sequence, or a decode row)
        logits_idx: list[int] = []
        hidden_idx: list[int] = []
        starts, counts, rows = [], [], []
        num_decodes = 0  # attention rows of decodes (decode items come first)
        decode_items = 0
        prefill_ends: list[int] = []
        image_rows: list = []
        image_spans: dict[int, list[tuple[int, int]]] = {}
        row_of = self.batch.row
        t = 0  # tokens so far
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            spec = item.spec_tokens
            if n == 1:
                ids.append(seq.token_ids[start])
            elif spec:
                ids.extend(seq.token_ids[start : start + n - len(spec)])
                ids.extend(spec)
            else:
                ids.extend(seq.token_ids[start : start + n])
            starts.append(start)
            counts.append(n)
            if paged:
                rows.append(row_of(seq))
            if item.is_decode:  # one query over the cache (or several, one row each)
                if prefill_ends:
                    raise ValueError("a step's decodes must come before its prefill chunks")
                seq_ids.extend([seq.seq_id] * n)
                num_decodes += n
                decode_items += 1
                if spec:
                    logits_idx.extend(range(t, t + n))
            else:
                seq_ids.append(seq.seq_id)
                prefill_ends.append(start + n)
            if images and item.images:
                _image_slices(item, t, image_rows, image_spans, len(seq_ids) - 1)
            if item.scores:  # the positions that score the prompt, before the row it samples from
                lo, hi = item.score_range()
                logits_idx.extend(range(t + lo - start, t + hi - start))
            if seq.pooling is not None:  # the positions a pooling request keeps
                lo, hi = item.pool_range()
                hidden_idx.extend(range(t + lo - start, t + hi - start))
            t += n
            if item.samples and not spec:
                logits_idx.append(t - 1)
        rows_kw = dict(logits_rows=logits_idx, hidden_rows=hidden_idx, images=image_rows, image_spans=image_spans)
        plan = StepPlan(ids, None, None, None, num_decodes, seq_ids, **rows_kw)
        return self._plan_arrays(plan, batch, starts, counts, rows if paged else None, decode_items, prefill_ends)

    def _plan_arrays(
        self,
        plan: StepPlan,
        batch: list[ScheduledSeq],
        starts: list[int],
        counts: list[int],
        rows: list[int] | None,
        decode_items: int,
        prefill_ends: list[int],
    ) -> StepPlan:
        """Positions, query and context lengths, and (paged) slots and block tables, as array
        operations over the items' starts and token counts."""
        num_decodes, t = plan.num_decodes, sum(counts)
        starts_a = np.array(starts, dtype=np.int64)
        counts_a = np.array(counts, dtype=np.int64)
        tok_items = np.repeat(np.arange(len(batch)), counts_a)  # each token's item
        first = np.cumsum(counts_a) - counts_a  # each item's first token in the flat batch
        pos = starts_a[tok_items] + np.arange(t) - first[tok_items]
        # Decode rows attend up to themselves; a prefill chunk's one row attends its whole context.
        ctx_lens = (pos[:num_decodes] + 1).tolist() + prefill_ends
        qsl = list(range(num_decodes + 1))
        for n in counts[decode_items:]:
            qsl.append(qsl[-1] + n)
        plan.pos, plan.query_start_loc, plan.context_lens = pos, qsl, ctx_lens
        if self.mrope:
            plan.rope_pos = _mrope_positions(batch, pos, first)
        if self.lora is not None:
            plan.lora_slots = self._lora_slots(batch, tok_items)
        if rows is not None:
            rows_a = np.array(rows, dtype=np.int64)
            tok_rows = rows_a[tok_items]
            # One table per attention row: decode rows repeat their sequence's row.
            attn_rows = np.concatenate([tok_rows[:num_decodes], rows_a[decode_items:]])
            self._paged_inputs(plan, tok_rows, attn_rows)
        return plan

    def _plan_one_token_each(self, batch: list[ScheduledSeq], paged: bool) -> StepPlan:
        """`plan` for a step of one token per sequence (decodes, one-token chunks): the common
        decode step, one pass per field over the sequences."""
        seqs = [it.seq for it in batch]
        starts = [s.num_computed_tokens for s in seqs]
        ids = [s.token_ids[p] for s, p in zip(seqs, starts)]
        # A one-token chunk in the middle of a prompt samples nothing.
        logits = [i for i, (s, p) in enumerate(zip(seqs, starts)) if p + 1 == len(s.token_ids)]
        pos = np.array(starts, dtype=np.int64)
        n = len(seqs)
        plan = StepPlan(
            ids, pos, list(range(n + 1)), [p + 1 for p in starts], n, [s.seq_id for s in seqs], logits_rows=logits
        )
        if self.mrope:
            plan.rope_pos = _mrope_positions(batch, pos, range(n))
        if self.lora is not None:
            plan.lora_slots = self._lora_slots(batch, None)
        if paged:
            b = self.batch
            row = b.row
            if b.num_groups == 1:  # InputBatch.row's unchanged case, inline: most rows, most steps
                row_of, versions, lens0 = b.row_of, b.versions, b.lens0
                rows = [
                    r
                    if (r := row_of.get(s.seq_id)) is not None
                    and versions[r] == s.table_version
                    and lens0[r] == len(s.block_table)
                    else row(s)
                    for s in seqs
                ]
            else:
                rows = [row(s) for s in seqs]
            rows_a = np.array(rows, dtype=np.int64)
            self._paged_inputs(plan, rows_a, rows_a)
        return plan

    def _lora_slots(self, batch: list[ScheduledSeq], tok_items: np.ndarray | None) -> np.ndarray | None:
        """Each token's adapter slot (tok_items: each token's item; None: one token per item),
        the step's adapters loaded into slots first; None when every row runs the base model."""
        reqs = {it.seq.lora_id: it.seq.lora for it in batch if it.seq.lora is not None}
        if not reqs:
            return None
        slot_of = self.lora.activate(reqs)
        items = np.array([slot_of[it.seq.lora_id] if it.seq.lora is not None else -1 for it in batch], dtype=np.int64)
        return items if tok_items is None else items[tok_items]

    def _paged_inputs(self, plan: StepPlan, tok_rows: np.ndarray, attn_rows: np.ndarray) -> None:
        """Slots of the step's tokens and the block tables of its attention rows, in every KV
        group, from the persistent rows (`tok_rows`: each token's row; `attn_rows`: each
        attention row's)."""
        bs = self.block_size
        pos = plan.pos
        blk, off = pos // bs, pos % bs
        for g in range(self.batch.num_groups):
            tables = self.batch.tables[g]
            slots = tables[tok_rows, blk] * bs + off
            width = int(self.batch.lens[g][attn_rows].max())
            flat = tables[attn_rows, :width].reshape(-1)
            if g == 0:
                plan.slots, plan.tables, plan.width = slots, flat, width
            else:
                plan.group_slots.append(slots)
                plan.group_tables.append(flat)
                plan.group_widths.append(width)

    def release(self, seq_id: int) -> None:
        """The sequence is done here (finished, preempted, aborted, scored): free its row."""
        self.batch.release(seq_id)

    def tensors(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        meta = AttentionMetadata(
            num_decodes=plan.num_decodes,
            seq_ids=plan.seq_ids,
            query_start_loc=plan.query_start_loc,
            context_lens=plan.context_lens,
            image_spans=plan.image_spans or None,
        )
        rope = plan.pos if plan.rope_pos is None else plan.rope_pos.reshape(-1)
        if not self.backend.uses_block_tables:
            input_ids, positions = self.upload.ints([plan.ids, rope])
            return input_ids, _rope_shape(positions, plan), meta
        extra = len(plan.group_slots)
        nd = plan.num_decodes
        # Decode rows are the first tokens and attend up to themselves: their lengths are pos + 1.
        dlens = plan.pos[:nd] + 1 if isinstance(plan.pos, np.ndarray) else plan.context_lens[:nd]
        up = self.upload.ints([plan.ids, rope, dlens, plan.slots, plan.tables, *plan.group_slots, *plan.group_tables])
        input_ids, positions, meta.decode_context_lens, meta.slot_mapping, flat_tables = up[:5]
        positions = _rope_shape(positions, plan)
        rows = len(plan.seq_ids)
        meta.block_tables = flat_tables.view(rows, plan.width)
        for g in range(extra):
            m = replace(meta, groups=[], _mask_cache={})
            m.slot_mapping = up[5 + g]
            m.block_tables = up[5 + extra + g].view(rows, plan.group_widths[g])
            meta.groups.append(m)
        return input_ids, positions, meta

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor | None:
        """Run the plan here; the logits of its `logits_rows` (None when it asks for none)."""
        return self.forward(plan)[0]

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`logits`, and the float32 final hidden states of the plan's `hidden_rows` (None when
        it asks for none), of this process's model. Under tensor or pipeline parallelism the
        engine's executor sends the plan to the other ranks first (engine/llm_engine.py); pooling
        is refused there, so rank 0 alone keeps hidden rows."""
        input_ids, positions, meta = self.tensors(plan)
        embeds = self._image_embeds(plan, input_ids) if plan.images else None
        hidden = self._run_model(plan, input_ids, positions, meta, embeds)
        kept = None
        if plan.hidden_rows:
            kept = hidden.index_select(0, self.upload.ints([plan.hidden_rows])[0]).float()
        if plan.logits_rows is None:
            return self.model.compute_logits(hidden), kept
        if not plan.logits_rows:
            return None, kept
        idx = self.upload.ints([plan.logits_rows])[0]
        return self.model.compute_logits(hidden.index_select(0, idx)), kept

    def _image_embeds(self, plan: StepPlan, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's input embeddings: the tokens', with each image's slice of embedding rows in
        place of its placeholder tokens. Images the encoder cache lacks are encoded first, all
        in one call of the vision tower (the scheduler kept them within the encoder budget)."""
        cache, found, todo = self.encoder_cache, {}, {}
        for _, im, _, _ in plan.images:
            if im.hash in found or im.hash in todo:
                continue
            emb = cache.get(im.hash)
            if emb is None:
                todo[im.hash] = im
            else:
                found[im.hash] = emb
        if todo:
            t0 = time.perf_counter()
            embs = self.model.encode_images([im.pixels for im in todo.values()])
            for (h, im), emb in zip(todo.items(), embs):
                if emb.shape[0] != im.num_embeds:
                    raise RuntimeError(
                        f"internal: the encoder gave {emb.shape[0]} rows for an image of "
                        f"{im.num_embeds} placeholder tokens"
                    )
                cache.put(h, emb)
                found[h] = emb
            self.encoder_stats["images_encoded"] += len(todo)
            self.encoder_stats["encoder_s"] += time.perf_counter() - t0
        embeds = self.model.embed(input_ids)
        for row, im, lo, hi in plan.images:
            where, k0, k1 = im.rows(lo, hi)
            emb = found[im.hash][k0:k1].to(embeds.dtype)
            if where is None:
                embeds[row : row + hi - lo] = emb
            elif where:
                embeds[torch.tensor(where, device=embeds.device) + row] = emb
        return embeds

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], images: bool = False) -> RunnerOutput | None:
        """Run one step here: `prepare_step`, `forward`, `sample`. Returns the sequences whose
        chunk reached their end and their tokens, and the logits of the prompt positions that
        scoring chunks keep (None: no logits). `images`: some chunk holds image tokens (the
        scheduler's `has_images`)."""
        step = self.prepare_step(batch, images)
        logits, hidden = self.forward(step.plan)
        return self.sample(step, logits, hidden)

    @torch.inference_mode()
    def prepare_step(self, batch: list[ScheduledSeq], images: bool = False) -> "PendingStep":
        """The step's plan, its sampling and scoring rows, and the grammar masks started."""
        # Decodes go first so the attention backend can batch them.
        batch = sorted(batch, key=lambda it: not it.is_decode)
        plan = self.plan(batch, images)
        # One row per sampling sequence; n > 1 siblings waiting to fork sample from their
        # parent's row (the prompt is computed once). A speculating sequence has one row per
        # query token: row j draws its output token num_output_tokens + j. A scoring chunk's
        # rows come before its sampling row, in the order plan() lists them.
        sampling_seqs, rows, offsets, drafts = [], [], [], []
        scoring = []  # (sequence, first position, first logits row, rows)
        pooling = []  # (sequence, first position, first kept hidden row, rows)
        k = h = 0
        for it in batch:
            if it.seq.pooling is not None:
                lo, hi = it.pool_range()
                if hi > lo:
                    pooling.append((it.seq, lo, h, hi - lo))
                    h += hi - lo
            if it.scores:
                lo, hi = it.score_range()
                if hi > lo:
                    scoring.append((it.seq, lo, k, hi - lo))
                    k += hi - lo
            if not it.samples:
                continue
            for j in range(len(it.spec_tokens) + 1):
                for s in (it.seq, *it.seq.fork_children):
                    sampling_seqs.append(s)
                    rows.append(k)
                    offsets.append(j)
                    drafts.append(it.spec_tokens if j == 0 else None)
                k += 1
        # Grammar masks are computed on another thread while the forward runs.
        masks = self.structured.start_masks(sampling_seqs, offsets, drafts) if self.structured else None
        # Only a step whose logits cross a process boundary reads this (distributed/stage.py).
        plan.argmax_only = (
            bool(sampling_seqs) and not scoring and masks is None and all(s.params.argmax_only for s in sampling_seqs)
        )
        return PendingStep(plan, sampling_seqs, rows, offsets, scoring, pooling, masks)

    @torch.inference_mode()
    def sample(
        self, step: "PendingStep", logits: torch.Tensor | None, hidden: torch.Tensor | None
    ) -> RunnerOutput | None:
        """The step's record from its logits (and kept hidden rows): sampled tokens, prompt
        scores, pooled rows."""
        sampling_seqs, rows, offsets, scoring, pooling, masks = (
            step.sampling_seqs,
            step.rows,
            step.offsets,
            step.scoring,
            step.pooling,
            step.masks,
        )
        pooled = [(seq, lo, hidden[h0 : h0 + c]) for seq, lo, h0, c in pooling]
        if logits is None:
            return RunnerOutput([], None, pooled=pooled) if pooled else None
        reduced = [x for x in scoring if x[0].score_kind not in KEEP_ROWS]
        scored = [(seq, lo, logits[k0 : k0 + c]) for seq, lo, k0, c in scoring if seq.score_kind in KEEP_ROWS]
        next_token = next_token_scores(logits, reduced) if reduced else []
        if not rows:
            return RunnerOutput([], None, scored, next_token, pooled)
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=self.device)]
        smeta = sampling_metadata(sampling_seqs, offsets)
        if masks is not None:  # the sampler applies them before anything else
            smeta.allowed_mask, smeta.mask_rows = masks.result(logits.device, len(sampling_seqs))
        # Rows with a NaN or inf logit fail their request (the sampler marks them -1 in its
        # token transfer, no extra device sync); the batch goes on.
        return RunnerOutput(sampling_seqs, self.sampler(logits, smeta, check_finite=True), scored, next_token, pooled)

    def _run_model(
        self, plan: StepPlan, input_ids: torch.Tensor, positions: torch.Tensor, meta, embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        kw = {} if embeds is None else {"inputs_embeds": embeds}
        if self.lora is None:
            return self.model(input_ids, positions, meta, **kw)
        self.lora.state.set_step(plan.lora_slots, self.device)  # the step's adapter row groups
        try:
            return self.model(input_ids, positions, meta, **kw)
        finally:
            self.lora.state.clear()


def _image_slices(item: ScheduledSeq, t: int, image_rows: list, image_spans: dict, row: int) -> None:
    """Each image's slice among a chunk's tokens (the chunk's first token at flat position `t`),
    and where the images attend both ways, their spans for the chunk's attention row `row`."""
    seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
    for im in item.images:
        lo, hi = max(start, im.offset), min(start + n, im.end)
        image_rows.append((t + lo - start, im, lo - im.offset, hi - im.offset))
    if seq.mm.bidirectional and not item.is_decode:
        image_spans[row] = seq.mm.spans(start, start + n)


def _mrope_positions(batch: list[ScheduledSeq], pos: np.ndarray, first) -> np.ndarray | None:
    """M-RoPE's rope positions of a step (`pos`: each token's index; `first`: each item's first
    token in the flat batch): an image prompt's tokens take their rows of its position table
    (multimodal/inputs.py), the rest their index. [T] where every token's three streams agree
    (text, decodes), [3, T] where some differ (image tokens); None: the indices themselves."""
    if all(it.seq.mm is None for it in batch):
        return None
    rope = np.broadcast_to(pos, (3, len(pos))).copy()
    for it, f in zip(batch, first):
        mm = it.seq.mm
        if mm is not None and mm.rope_positions is not None:
            start = it.seq.num_computed_tokens
            rope[:, f : f + it.num_new_tokens] = mm.rope_rows(start, start + it.num_new_tokens)
    if (rope[0] == rope[1]).all() and (rope[0] == rope[2]).all():
        return rope[0]
    return rope


def _rope_shape(positions: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    """The uploaded rope positions as the model takes them: [3, T] for M-RoPE rows, else [T]."""
    return positions.view(3, -1) if plan.rope_pos is not None and plan.rope_pos.ndim == 2 else positions


def sampling_metadata(seqs: list[Sequence], offsets: list[int] | None = None) -> SamplingMetadata:
    """offsets: per row, how many tokens past the sequence's next one it draws (speculative
    verification rows), so a seeded row keys its noise by the output position it decides."""
    params = [s.params for s in seqs]
    offsets = offsets or [0] * len(seqs)
    return SamplingMetadata(
        params=params,
        seq_ids=[s.seq_id for s in seqs],
        token_ids=[s.token_ids for s in seqs],
        num_prompt_tokens=[s.num_prompt_tokens for s in seqs],
        seeds=[None if p.seed is None else p.seed + s.index for s, p in zip(seqs, params)],
        output_pos=[s.num_output_tokens + j for s, j in zip(seqs, offsets)],
    )
