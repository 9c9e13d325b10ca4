"""OLMoE: sparse MoE blocks in every layer, and q/k RMSNorms over the whole q and k projections
(not per head as Qwen3's); `clip_qkv` clamps q, k and v after those norms."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..quant import kernels as qk
from .llama import Attention, RMSNorm
from .moe import MoeDecoderLayer, MoeForCausalLM


class OlmoeAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, qk_norm=None, shard=None, tp=None) -> None:
        super().__init__(cfg, layer_idx, None, shard, tp)
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)
        self.clip = cfg.clip_qkv

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        if self._native_qk_norm(qkv):
            return qk.qk_norm(
                qkv,
                self.q_norm.weight,
                self.k_norm.weight,
                self.num_heads,
                self.num_kv_heads,
                self.q_norm.eps,
                self.clip,
            )
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        return qkv if self.clip is None else qkv.clamp_(-self.clip, self.clip)


class OlmoeDecoderLayer(MoeDecoderLayer):
    attn_cls = OlmoeAttention
    stack_decode = True  # the all-layer decode applies the whole-projection q/k norms and the clip too


class OlmoeForCausalLM(MoeForCausalLM):
    layer_cls = OlmoeDecoderLayer
