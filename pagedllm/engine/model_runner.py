"""Turns a scheduled batch into tensors once, runs the model, samples.

Order in the flat batch: decodes first (one token each, attended in one
batched call), then prefill chunks.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..attention.metadata import AttentionMetadata
from ..sampling.metadata import SamplingMetadata
from ..sampling.sampler import Sampler, SamplerOutput
from .scheduler import ScheduledSeq
from .sequence import Sequence


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
        for i, attn in enumerate(model.attention_modules()):
            attn.attn = backend.layer(i, attn.window, attn.scale, attn.softcap)

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        paged = self.backend.uses_block_tables
        groups = getattr(self.backend, "num_groups", 1)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[list[int]] = [[] for _ in range(groups)]  # per KV group
        qsl = [0]
        ctx_lens: list[int] = []
        logits_idx: list[int] = []
        num_decodes = 0
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            if n == 1:  # one query over the cache: the batched decode path
                num_decodes += 1
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            if paged:
                for g, table in enumerate([seq.block_table, *seq.group_tables] if groups > 1 else
                                          [seq.block_table]):
                    slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + n)
            ctx_lens.append(end)
            if item.samples:
                logits_idx.append(qsl[-1] - 1)
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            seq_ids=[it.seq.seq_id for it in batch],
            query_start_loc=qsl,
            context_lens=ctx_lens,
        )
        if not paged:
            input_ids, positions = self.upload.ints([ids, pos])
            return input_ids, positions, meta, logits_idx
        tables = [_padded_tables([it.seq.block_table if g == 0 else it.seq.group_tables[g - 1]
                                  for it in batch]) for g in range(groups)]
        up = self.upload.ints([ids, pos, ctx_lens[:num_decodes]] + slots + [t for t, _ in tables])
        input_ids, positions, meta.decode_context_lens = up[:3]
        for g in range(groups):
            m = meta if g == 0 else replace(meta, groups=[], _mask_cache={})
            m.slot_mapping = up[3 + g]
            m.block_tables = up[3 + groups + g].view(len(batch), tables[g][1])
            if g:
                meta.groups.append(m)
        return input_ids, positions, meta, logits_idx

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> tuple[list[Sequence], SamplerOutput] | None:
        """Run one step; returns the sequences whose chunk reached their end and their tokens."""
        # Decodes go first so the attention backend can batch them.
        batch = sorted(batch, key=lambda it: not _is_decode(it))
        input_ids, positions, meta, logits_idx = self.prepare(batch)
        # One row per sampling sequence; n > 1 siblings waiting to fork sample from their
        # parent's row (the prompt is computed once).
        sampling_seqs, rows = [], []
        for k, seq in enumerate(it.seq for it in batch if it.samples):
            for s in (seq, *seq.fork_children):
                sampling_seqs.append(s)
                rows.append(k)
        # Grammar masks are computed on another thread while the forward runs.
        masks = self.structured.start_masks(sampling_seqs) if self.structured else None
        hidden = self.model(input_ids, positions, meta)
        if not logits_idx:
            return None
        idx = self.upload.ints([logits_idx])[0]
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=self.device)]
        # A sum is finite only if every logit is (NaN and inf propagate): a cheap check that
        # the sampler folds into its token transfer, so it costs no extra device sync. It must
        # see the model's own logits: a -inf mask applied to them later is not a failure.
        finite = logits.sum(-1, dtype=torch.float32).isfinite()
        smeta = sampling_metadata(sampling_seqs)
        if masks is not None:  # the sampler applies them before anything else
            smeta.allowed_mask, smeta.mask_rows = masks.result(logits.device, len(sampling_seqs))
        return sampling_seqs, self.sampler(logits, smeta, finite=finite)

    @torch.inference_mode()
    def chunk_logits(self, item: ScheduledSeq) -> torch.Tensor:
        """Logits for every token of one sequence's chunk (scoring, perplexity)."""
        input_ids, positions, meta, _ = self.prepare([item])
        return self.model.compute_logits(self.model(input_ids, positions, meta))


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


def sampling_metadata(seqs: list[Sequence]) -> SamplingMetadata:
    params = [s.params for s in seqs]
    return SamplingMetadata(
        params=params,
        seq_ids=[s.seq_id for s in seqs],
        token_ids=[s.token_ids for s in seqs],
        num_prompt_tokens=[s.num_prompt_tokens for s in seqs],
        seeds=[None if p.seed is None else p.seed + s.index for s, p in zip(seqs, params)],
        output_pos=[s.num_output_tokens for s in seqs],
    )


def _padded_tables(tables: list[list[int]]) -> tuple[list[int], int]:
    """The tables flattened, each padded with the null block to the longest; and that width."""
    width = max(len(t) for t in tables)
    flat: list[int] = []
    for t in tables:
        flat += t
        flat += [0] * (width - len(t))
    return flat, width


def _is_decode(item: ScheduledSeq) -> bool:
    return item.num_new_tokens == 1
