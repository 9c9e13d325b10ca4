"""The seam between models and KV storage: the only part of `attention/` a model imports.

A model's attention layer computes q, k, v and hands them to its `AttentionLayer` together
with the step's `AttentionContext`; the layer stores k/v wherever its backend keeps them and
returns the attention output. Models never see blocks, slots, cache tensors or sequences:
the context is opaque to them, they only pass it on and ask it the questions below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch


@dataclass
class DecodeStack:
    """A decode-only step's paged cache, for a kernel that runs every layer in one call
    (`quant.kernels.decode_layers`): each layer's K and V pools and window (0: none), and the
    step's slot mapping, block tables and context lengths. Built by the context, handed by the
    model to the kernel unread. A quantized cache (int8, f8e4m3) adds each layer's scales."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    windows: list[int]
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    k_scales: list[torch.Tensor] = field(default_factory=list)  # empty: a plain cache
    v_scales: list[torch.Tensor] = field(default_factory=list)


class AttentionContext(Protocol):
    """What one forward pass tells the attention layers about the flattened batch."""

    def decode_stack(
        self, layers: Sequence["AttentionLayer"], dtype: torch.dtype, pools: dict | None = None
    ) -> DecodeStack | None:
        """The cache view for running all `layers` of a decode-only step in one native call, or
        None where that path does not apply (prefill rows, another backend, KV groups).
        `pools`: a memo the caller keeps with `layers` (emptied when they change), so that the
        layers' pools are looked up once, not every step."""
        ...


class AttentionLayer(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the flat batch; returns [T, Hq, D]."""
        ...

    def decode_qkv(
        self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext, hq: int, hkv: int
    ) -> torch.Tensor | None:
        """A decode-only step from the fused q|k|v projection in one call (rope, cache write,
        attention): [T, Hq * D]; None where the backend has no such path."""
        ...

    def stack_kv(self, dtype: torch.dtype) -> tuple | None:
        """(K pool, V pool, window or 0, K scales, V scales) when a fused all-layer decode may
        write and read this layer's cache in place under compute `dtype` (the scales: a quantized
        cache's, int8 or f8e4m3, else None); None otherwise."""
        ...


class AttentionBackend(Protocol):
    name: str
    uses_block_tables: bool
    num_groups: int  # KV groups whose block tables a step carries (kv/groups.py); 1 without groups

    def layer(self, index: int, window: int | None, scale: float, softcap: float | None = None) -> AttentionLayer: ...

    def describe_decode(self) -> str:
        """The path decode attention really takes, and why (for the KV trace)."""
        ...

    def free_seq(self, seq_id: int) -> None: ...

    def fork_seq(self, parent_id: int, child_id: int) -> None: ...
