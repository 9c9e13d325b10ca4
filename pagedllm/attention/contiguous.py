"""Contiguous KV per sequence, grown as needed: the path for `paged_attention=False`.

Each sequence owns one K and one V buffer per layer; attention runs one
sequence at a time. Block accounting still happens in the block manager so
capacity and preemption behave the same as the paged path.
"""
from __future__ import annotations

import torch

from .metadata import AttentionMetadata
from .paged import sdpa_one


class ContiguousBackend:
    name = "torch-contiguous"
    uses_block_tables = False

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        # seq_id -> per layer [k_buf, v_buf]
        self.store: dict[int, dict[int, list[torch.Tensor]]] = {}

    def layer(self, index: int, window: int | None, scale: float) -> "ContiguousLayer":
        return ContiguousLayer(self, index, window, scale)

    def free_seq(self, seq_id: int) -> None:
        self.store.pop(seq_id, None)

    def fork_seq(self, parent_id: int, child_id: int) -> None:
        """n > 1: the child starts from a copy of the parent's K/V (no sharing without pages)."""
        parent = self.store.get(parent_id, {})
        self.store[child_id] = {i: [b.clone() for b in bufs] for i, bufs in parent.items()}

    @property
    def num_seqs_held(self) -> int:
        return len(self.store)

    def buffers(self, seq_id: int, layer: int, needed: int, like: torch.Tensor) -> list[torch.Tensor]:
        per_layer = self.store.setdefault(seq_id, {})
        bufs = per_layer.get(layer)
        if bufs is None or bufs[0].shape[0] < needed:
            cap = max(64, needed, 2 * (bufs[0].shape[0] if bufs else 0))
            new = [torch.zeros((cap, *like.shape[1:]), dtype=self.dtype, device=self.device)
                   for _ in range(2)]
            if bufs is not None:
                used = bufs[0].shape[0]
                new[0][:used] = bufs[0]
                new[1][:used] = bufs[1]
            per_layer[layer] = bufs = new
        return bufs


class ContiguousLayer:
    def __init__(self, backend: ContiguousBackend, index: int, window: int | None,
                 scale: float) -> None:
        self.backend, self.index, self.window, self.scale = backend, index, window, scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        for i, sid in enumerate(meta.seq_ids):
            s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            ctx = meta.context_lens[i]
            kb, vb = self.backend.buffers(sid, self.index, ctx, k)
            kb[ctx - (e - s):ctx] = k[s:e]
            vb[ctx - (e - s):ctx] = v[s:e]
            out[s:e] = sdpa_one(q[s:e], kb[:ctx].to(q.dtype), vb[:ctx].to(q.dtype), ctx,
                                self.window, self.scale)
        return out
