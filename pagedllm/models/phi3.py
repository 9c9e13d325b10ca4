"""Phi-3 / Phi-3.5: the Llama architecture, stored with q/k/v and gate/up already fused.

The checkpoint's `qkv_proj` and `gate_up_proj` are our fused projections as they are (q|k|v
rows and gate|up rows, in that order), so the name map passes them through. Under tensor
parallelism a rank's q, k and v heads (gate and up rows) lie apart in those tensors, so they are
split into the parts other families store, which the shard map cuts (models/parallel.py).
LongRoPE ("longrope"/"su") scaling lives in rope.py.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from ..quant.formats import QuantTensor
from .llama import LlamaForCausalLM
from .parallel import narrow


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantTensor]], dtype: torch.dtype = torch.float32
    ) -> None:
        super().load_weights(weights if self.tp is None else self._unfused(weights), dtype)

    def _unfused(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantTensor]]
    ) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """The fused q|k|v and gate|up tensors as their parts, under the names other families use."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        parts = {
            "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
            "gate_up_proj": (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)),
        }
        for name, t in weights:
            fused = next((f for f in parts if f".{f}." in name), None)
            if fused is None:
                yield name, t
                continue
            start = 0
            for part, rows in parts[fused]:
                yield name.replace(f".{fused}.", f".{part}."), narrow(t, 0, start, rows, name)
                start += rows
