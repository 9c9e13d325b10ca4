"""What one forward pass tells the attention layers about the flattened batch: the
AttentionContext (backend.py) that the model runner builds and models only pass on.

The batch is a flat run of tokens. The first `num_decodes` sequences contribute
one token each (decodes); the rest are prefill chunks. Everything is built once
per step by the model runner and read by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .backend import AttentionLayer, DecodeStack


def layer_pools(layers: Sequence[AttentionLayer], dtype: torch.dtype) -> tuple | None:
    """(K pools, V pools, windows, K scales, V scales) of `layers` for the all-layer decode
    under `dtype` (the scales empty for a plain cache); None unless every layer's cache can be
    read in place."""
    k, v, windows, ks, vs = [], [], [], [], []
    for layer in layers:
        kv = layer.stack_kv(dtype)
        if kv is None:
            return None
        k.append(kv[0])
        v.append(kv[1])
        windows.append(kv[2])
        if kv[3] is not None:
            ks.append(kv[3])
            vs.append(kv[4])
    if ks and len(ks) != len(k):  # (one cache: its layers are all quantized or none is)
        return None
    return k, v, windows, ks, vs


@dataclass
class AttentionMetadata:
    num_decodes: int
    # Per sequence, in batch order (decodes first).
    seq_ids: list[int]
    query_start_loc: list[int]  # len = num_seqs + 1, offsets into the flat tokens
    context_lens: list[int]  # tokens in context after this step, per sequence
    # Paged-cache tensors (None for the contiguous backend).
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64: where each new K/V goes
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] int64, padded with 0
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64
    # KV groups after the first (kv/groups.py): the same batch with their slot mappings and
    # block tables.
    groups: list["AttentionMetadata"] = field(default_factory=list)
    # Bidirectional image attention (Gemma 3): per prefill sequence index, the [start, end)
    # positions of the images among its queries; their tokens attend to their whole image.
    image_spans: dict[int, list[tuple[int, int]]] | None = None
    # Masks and slot ids are shared by every layer: built once, on first use.
    _mask_cache: dict = field(default_factory=dict, repr=False)

    def group(self, g: int) -> "AttentionMetadata":
        return self if g == 0 else self.groups[g - 1]

    def decode_stack(
        self, layers: Sequence[AttentionLayer], dtype: torch.dtype, pools: dict | None = None
    ) -> DecodeStack | None:
        """The paged cache of a decode-only step for one call over all `layers` (the
        AttentionContext question); None unless every layer's cache can be read in place.
        `pools`: the caller's memo of the layers' pools per dtype, which it empties when the
        layers change."""
        if self.num_decodes != len(self.seq_ids) or self.slot_mapping is None:
            return None
        found = pools.get(dtype, False) if pools is not None else False
        if found is False:
            found = layer_pools(layers, dtype)
            if pools is not None:
                pools[dtype] = found
        if found is None:
            return None
        k, v, windows, ks, vs = found
        return DecodeStack(k, v, windows, self.slot_mapping, self.block_tables, self.decode_context_lens, ks, vs)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    def prefill_mask(self, i: int, window: int | None, device) -> torch.Tensor | None:
        """Sequence i's causal mask (see `causal_mask`), built on the first layer that asks."""
        key = ("prefill", i, window)
        if key not in self._mask_cache:
            n = self.query_start_loc[i + 1] - self.query_start_loc[i]
            spans = self.image_spans.get(i) if self.image_spans else None
            if spans:
                self._mask_cache[key] = image_mask(n, self.context_lens[i], window, spans, device)
            else:
                self._mask_cache[key] = causal_mask(n, self.context_lens[i], window, device)
        return self._mask_cache[key]

    def has_image_mask(self, i: int) -> bool:
        """Sequence i's prefill attends bidirectionally over image tokens (no native kernel)."""
        return bool(self.image_spans and self.image_spans.get(i))

    @property
    def max_decode_len(self) -> int:
        return max(self.context_lens[: self.num_decodes])

    def decode_slots(self, block_size: int) -> torch.Tensor:
        """[num_decodes, max_decode_len] slot ids of every decode's context (see `context_slots`)."""
        key = ("slots", block_size)
        s = self._mask_cache.get(key)
        if s is None:
            nd = self.num_decodes
            s = context_slots(self.block_tables[:nd], self.decode_context_lens, self.max_decode_len, block_size)
            self._mask_cache[key] = s
        return s

    def prefill_slots(self, i: int, block_size: int) -> torch.Tensor:
        """[context_lens[i]] slot ids of sequence i's whole context, every one written."""
        key = ("prefill", i, block_size)
        s = self._mask_cache.get(key)
        if s is None:
            n = self.context_lens[i]
            j = torch.arange(n, device=self.block_tables.device)
            s = self.block_tables[i, j // block_size] * block_size + j % block_size
            self._mask_cache[key] = s
        return s

    def decode_mask(self, window: int | None, num_keys: int) -> torch.Tensor:
        """[num_decodes, 1, 1, num_keys] bool: True where a decode query may attend."""
        key = ("decode", window, num_keys)
        m = self._mask_cache.get(key)
        if m is None:
            assert self.decode_context_lens is not None
            lens = self.decode_context_lens[:, None]
            j = torch.arange(num_keys, device=lens.device)[None, :]
            m = j < lens
            if window is not None:
                m &= j >= lens - window
            m = m[:, None, None, :]
            self._mask_cache[key] = m
        return m


def context_slots(table: torch.Tensor, lens: torch.Tensor, num_keys: int, block_size: int) -> torch.Tensor:
    """[N, num_keys] flat slot ids of positions 0..num_keys-1 of each sequence (table [N, W],
    lens [N]); positions at or past a sequence's length read slot 0 of the zeroed null block,
    so a read never touches a slot that was not written."""
    j = torch.arange(num_keys, device=table.device)[None, :]
    slots = table.gather(1, (j // block_size).expand(table.shape[0], -1)) * block_size + j % block_size
    return slots.masked_fill_(j >= lens[:, None], 0)


def causal_mask(q_len: int, ctx_len: int, window: int | None, device, force: bool = False) -> torch.Tensor | None:
    """[q_len, ctx_len] bool for queries at the last q_len positions; None when plain causal
    works (unless `force`)."""
    if window is None and q_len == ctx_len and not force:
        return None
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(ctx_len, device=device)[None, :]
    m = k_pos <= q_pos
    if window is not None:
        m &= k_pos > q_pos - window
    return m


def image_mask(q_len: int, ctx_len: int, window: int | None, spans: list[tuple[int, int]], device) -> torch.Tensor:
    """`causal_mask` where each image's tokens also see every token of their image, as
    transformers' Gemma 3 mask with token_type_ids does: (causal OR same image), then AND the
    sliding window (key > query - window) on sliding layers."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(ctx_len, device=device)[None, :]
    m = k_pos <= q_pos
    for a, b in spans:
        m |= (q_pos >= a) & (q_pos < b) & (k_pos >= a) & (k_pos < b)
    if window is not None:
        m &= k_pos > q_pos - window
    return m
