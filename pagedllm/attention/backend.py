"""The seam between models and KV storage.

A model's attention layer computes q, k, v and hands them to its
`AttentionLayer`; the layer stores k/v wherever its backend keeps them and
returns the attention output. Models never see blocks or sequences.
"""
from __future__ import annotations

from typing import Protocol

import torch

from .metadata import AttentionMetadata


class AttentionLayer(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the flat batch; returns [T, Hq, D]."""
        ...


class AttentionBackend(Protocol):
    name: str
    uses_block_tables: bool

    def layer(self, index: int, window: int | None, scale: float,
              softcap: float | None = None) -> AttentionLayer: ...

    def describe_decode(self) -> str:
        """The path decode attention really takes, and why (for the KV trace)."""
        ...

    def free_seq(self, seq_id: int) -> None: ...

    def fork_seq(self, parent_id: int, child_id: int) -> None: ...
