"""Turns a scheduled batch into tensors once, runs the model, samples.

Order in the flat batch: decodes first (one token each, attended in one
batched call), then prefill chunks.
"""
from __future__ import annotations

import torch

from ..attention.metadata import AttentionMetadata
from ..sampling.sampler import Sampler, SamplerOutput
from .scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend, block_size: int,
                 device: torch.device, sampler: Sampler) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.structured = None  # a GrammarEngine, set by the engine
        for i, attn in enumerate(model.attention_modules()):
            attn.attn = backend.layer(i, attn.window, attn.scale)

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
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
            if self.backend.uses_block_tables:
                table = seq.block_table
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + n)
            ctx_lens.append(end)
            if item.samples:
                logits_idx.append(qsl[-1] - 1)
        dev = self.device
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            seq_ids=[it.seq.seq_id for it in batch],
            query_start_loc=qsl,
            context_lens=ctx_lens,
        )
        if self.backend.uses_block_tables:
            width = max(len(it.seq.block_table) for it in batch)
            tables = [it.seq.block_table + [0] * (width - len(it.seq.block_table)) for it in batch]
            meta.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=dev)
            meta.block_tables = torch.tensor(tables, dtype=torch.int64, device=dev)
            meta.decode_context_lens = torch.tensor(ctx_lens[:num_decodes], dtype=torch.int64, device=dev)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        return input_ids, positions, meta, logits_idx

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> SamplerOutput | None:
        """Run one step; returns tokens for the sequences whose chunk reached their end."""
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
        idx = torch.tensor(logits_idx, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=self.device)]
        if masks is not None:
            logits = masks.apply(logits)
        out = self.sampler(logits, sampling_seqs)
        out.seqs = sampling_seqs
        return out

    @torch.inference_mode()
    def chunk_logits(self, item: ScheduledSeq) -> torch.Tensor:
        """Logits for every token of one sequence's chunk (scoring, perplexity)."""
        input_ids, positions, meta, _ = self.prepare([item])
        return self.model.compute_logits(self.model(input_ids, positions, meta))


def _is_decode(item: ScheduledSeq) -> bool:
    return item.num_new_tokens == 1
