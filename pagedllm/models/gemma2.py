"""Gemma 2: alternating sliding and global layers, and Gemma's own layer shape.

- RMSNorm multiplies by (1 + weight): checkpoints store weight - 1 (GGUF files already hold
  1 + weight), so the loader adds one and the plain RMSNorm, and its fused native path, serve.
- Each sub-block is normed before and after: h + post_norm(attn(pre_norm(h))), the same
  around the MLP.
- Embeddings are scaled by sqrt(hidden_size), rounded to the compute dtype as transformers does.
- The MLP is GeGLU with tanh GELU; attention scales by query_pre_attn_scalar ** -0.5.
- Attention scores and final logits are soft-capped: cap * tanh(x / cap).

Under tensor parallelism it splits as Llama does (models/parallel.py): the extra norms act on
o_proj's and down_proj's all-reduced outputs, the score cap and Gemma 3's q/k norms on each of
a rank's own heads, the embedding scale on the all-reduced lookup and the logit cap on the
gathered row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.backend import AttentionContext
from ..config import ModelConfig
from .llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from .parallel import ShardLayout


class GemmaMLP(MLP):
    def forward(
        self, x: torch.Tensor, norm: nn.Module | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        gate, up = self.gate_up_proj.fused(x, norm=norm).chunk(2, dim=-1)
        return self.down_proj.fused(F.gelu(gate, approximate="tanh") * up, residual=residual)


class Gemma2DecoderLayer(nn.Module):
    qk_norm: type[nn.Module] | None = None

    def __init__(self, cfg: ModelConfig, layer_idx: int, shard: ShardLayout | None = None, tp=None) -> None:
        super().__init__()
        if cfg.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(
                f"Gemma with hidden_activation={cfg.hidden_activation!r} is not supported "
                "(supported: gelu_pytorch_tanh)"
            )
        # Row-parallel o_proj / down_proj all-reduce before returning, so the post-norms below
        # see the whole sum.
        self.self_attn = Attention(cfg, layer_idx, self.qk_norm, shard, tp)
        self.mlp = GemmaMLP(cfg, shard, tp)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor, meta: AttentionContext) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(rope, h, meta, norm=self.input_layernorm))
        return h + self.post_feedforward_layernorm(self.mlp(h, norm=self.pre_feedforward_layernorm))


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma2DecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int, tp=None, stage=None) -> None:
        super().__init__(cfg, max_positions, tp, stage)
        self.embed_scale = cfg.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        return h * torch.tensor(self.embed_scale, dtype=h.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)  # None on a tensor-parallel rank other than 0
        cap = self.config.final_logit_softcapping
        return logits if cap is None or logits is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights, dtype: torch.dtype = torch.float32) -> None:
        # HF names, HF values (the GGUF reader turns the file's 1 + weight back into weight).
        # Added in the compute dtype: exact in float32; in bf16, 1 + w is rounded once.
        super().load_weights(((n, t + 1 if n.endswith("norm.weight") else t) for n, t in weights), dtype)
