"""Turns a scheduled batch into tensors once, runs the model, samples.

Order in the flat batch: decodes first (one token each, attended in one
batched call), then prefill chunks.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..attention.metadata import AttentionMetadata
from ..sampling.metadata import SamplingMetadata
from ..sampling.sampler import Sampler, SamplerOutput
from .scheduler import ScheduledSeq
from .sequence import Sequence


@dataclass
class StepPlan:
    """One forward pass as plain lists: what rank 0 decides and, under tensor parallelism,
    sends to the other ranks (distributed/executor.py), so every rank builds the same tensors."""

    ids: list[int]
    pos: list[int]
    query_start_loc: list[int]
    context_lens: list[int]
    num_decodes: int
    seq_ids: list[int]
    slots: list[int] = field(default_factory=list)  # paged backends only
    tables: list[int] = field(default_factory=list)  # [num_seqs * width], padded with 0
    width: int = 0
    # Rows of the flat batch to compute logits for; None: every row (scoring a chunk).
    logits_rows: list[int] | None = field(default_factory=list)
    # KV groups after the first (kv/groups.py: sliding layers beside global ones): their slot
    # mappings and flat tables. (Tensor parallelism runs single-group models and sends none.)
    group_slots: list[list[int]] = field(default_factory=list)
    group_tables: list[list[int]] = field(default_factory=list)
    group_widths: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend, block_size: int,
                 device: torch.device, sampler: Sampler) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.upload = HostUpload(device)
        self.structured = None  # a GrammarEngine, set by the engine
        self.driver = None  # under tensor parallelism: rank 0's TPExecutor, which sends each plan
        for i, attn in enumerate(model.attention_modules()):
            attn.attn = backend.layer(i, attn.window, attn.scale, attn.softcap)

    def plan(self, batch: list[ScheduledSeq]) -> StepPlan:
        """The step's inputs as plain lists (under tensor parallelism rank 0 sends them to the
        other ranks). A decode with speculative proposals becomes one decode row per query token
        (its last token, then each proposal), each over the same block table with the context up
        to itself: the batched decode kernel then verifies the proposals, and each row's
        attention is computed exactly as a one-token decode at that place would be."""
        bs = self.block_size
        paged = self.backend.uses_block_tables
        groups = getattr(self.backend, "num_groups", 1)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[list[int]] = [[] for _ in range(groups)]  # per KV group
        qsl = [0]
        ctx_lens: list[int] = []
        logits_idx: list[int] = []
        row_seqs: list[Sequence] = []  # one entry per attention row (a sequence, or a decode row)
        num_decodes = 0
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            spec = item.spec_tokens
            ids.extend(seq.token_ids[start:end - len(spec)])
            ids.extend(spec)
            pos.extend(range(start, end))
            if paged:
                for g, table in enumerate(_seq_tables(seq, groups)):
                    slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if item.is_decode:  # one query over the cache (or several, one row each)
                for p in range(start + 1, end + 1):
                    qsl.append(qsl[-1] + 1)
                    ctx_lens.append(p)
                    row_seqs.append(seq)
                    num_decodes += 1
                if spec:
                    logits_idx.extend(range(qsl[-1] - n, qsl[-1]))
            else:
                qsl.append(qsl[-1] + n)
                ctx_lens.append(end)
                row_seqs.append(seq)
            if item.samples and not spec:
                logits_idx.append(qsl[-1] - 1)
        plan = StepPlan(ids, pos, qsl, ctx_lens, num_decodes, [s.seq_id for s in row_seqs], slots[0],
                        logits_rows=logits_idx)
        if paged:  # one table per attention row, in each group
            for g in range(groups):
                flat, width = _padded_tables([_seq_tables(s, groups)[g] for s in row_seqs])
                if g == 0:
                    plan.tables, plan.width = flat, width
                else:
                    plan.group_slots.append(slots[g])
                    plan.group_tables.append(flat)
                    plan.group_widths.append(width)
        return plan

    def tensors(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        meta = AttentionMetadata(num_decodes=plan.num_decodes, seq_ids=plan.seq_ids,
                                 query_start_loc=plan.query_start_loc, context_lens=plan.context_lens)
        if not self.backend.uses_block_tables:
            input_ids, positions = self.upload.ints([plan.ids, plan.pos])
            return input_ids, positions, meta
        extra = len(plan.group_slots)
        up = self.upload.ints([plan.ids, plan.pos, plan.context_lens[:plan.num_decodes], plan.slots, plan.tables,
                               *plan.group_slots, *plan.group_tables])
        input_ids, positions, meta.decode_context_lens, meta.slot_mapping, flat_tables = up[:5]
        rows = len(plan.seq_ids)
        meta.block_tables = flat_tables.view(rows, plan.width)
        for g in range(extra):
            m = replace(meta, groups=[], _mask_cache={})
            m.slot_mapping = up[5 + g]
            m.block_tables = up[5 + extra + g].view(rows, plan.group_widths[g])
            meta.groups.append(m)
        return input_ids, positions, meta

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        plan = self.plan(batch)
        return (*self.tensors(plan), plan.logits_rows)

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor | None:
        """Run the plan; the logits of its `logits_rows` (None when it asks for none). Under
        tensor parallelism rank 0 first sends the plan, and every rank runs this."""
        if self.driver is None:
            return self._logits(plan)
        with self.driver.guard():  # a failed rank fails the step with a clear error
            self.driver.send_step(plan)
            return self._logits(plan)

    def _logits(self, plan: StepPlan) -> torch.Tensor | None:
        input_ids, positions, meta = self.tensors(plan)
        hidden = self.model(input_ids, positions, meta)
        if plan.logits_rows is None:
            return self.model.compute_logits(hidden)
        if not plan.logits_rows:
            return None
        idx = self.upload.ints([plan.logits_rows])[0]
        return self.model.compute_logits(hidden.index_select(0, idx))

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> tuple[list[Sequence], SamplerOutput] | None:
        """Run one step; returns the sequences whose chunk reached their end and their tokens."""
        # Decodes go first so the attention backend can batch them.
        batch = sorted(batch, key=lambda it: not it.is_decode)
        plan = self.plan(batch)
        # One row per sampling sequence; n > 1 siblings waiting to fork sample from their
        # parent's row (the prompt is computed once). A speculating sequence has one row per
        # query token: row j draws its output token num_output_tokens + j.
        sampling_seqs, rows, offsets, drafts = [], [], [], []
        k = 0
        for it in batch:
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
        logits = self.logits(plan)
        if logits is None:
            return None
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=self.device)]
        # A sum is finite only if every logit is (NaN and inf propagate): a cheap check that
        # the sampler folds into its token transfer, so it costs no extra device sync. It must
        # see the model's own logits: a -inf mask applied to them later is not a failure.
        finite = logits.sum(-1, dtype=torch.float32).isfinite()
        smeta = sampling_metadata(sampling_seqs, offsets)
        if masks is not None:  # the sampler applies them before anything else
            smeta.allowed_mask, smeta.mask_rows = masks.result(logits.device, len(sampling_seqs))
        return sampling_seqs, self.sampler(logits, smeta, finite=finite)

    @torch.inference_mode()
    def hidden_states(self, plan: StepPlan) -> torch.Tensor:
        """The final-norm hidden states of every row of the plan ([T, hidden]): what an
        embedding model outputs (engine/pooling.py)."""
        if self.driver is not None:
            raise ValueError("hidden states under tensor parallelism are not supported")
        input_ids, positions, meta = self.tensors(plan)
        return self.model(input_ids, positions, meta)

    def chunk_logits(self, item: ScheduledSeq) -> torch.Tensor:
        """Logits for every token of one sequence's chunk (scoring, perplexity)."""
        plan = self.plan([item])
        plan.logits_rows = None
        return self.logits(plan)


class HostUpload:
    """Step inputs to the device. On CUDA: one copy per call from a reused pinned buffer,
    non_blocking, waiting only before the buffer is refilled. Elsewhere: plain torch.tensor."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._buf: torch.Tensor | None = None
        self._copied = None  # event: the last copy out of _buf has finished

    def ints(self, parts: list[list[int]]) -> list[torch.Tensor]:
        """int64 tensors on the device, one per list."""
        if not self.pinned:
            return [torch.tensor(p, dtype=torch.int64, device=self.device) for p in parts]
        sizes = [len(p) for p in parts]
        total = sum(sizes)
        if self._copied is not None:
            self._copied.synchronize()
        if self._buf is None or self._buf.numel() < total:
            self._buf = torch.empty(max(total, 4096, 2 * (0 if self._buf is None else self._buf.numel())),
                                    dtype=torch.int64, pin_memory=True)
        host = self._buf.numpy()
        off = 0
        for p in parts:
            host[off:off + len(p)] = p
            off += len(p)
        out = self._buf[:total].to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return list(out.split(sizes))


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


def _seq_tables(seq: Sequence, groups: int) -> list[list[int]]:
    """seq's block table of each KV group."""
    return [seq.block_table, *seq.group_tables] if groups > 1 else [seq.block_table]


def _padded_tables(tables: list[list[int]]) -> tuple[list[int], int]:
    """The tables flattened, each padded with the null block to the longest; and that width."""
    width = max(len(t) for t in tables)
    flat: list[int] = []
    for t in tables:
        flat += t
        flat += [0] * (width - len(t))
    return flat, width
