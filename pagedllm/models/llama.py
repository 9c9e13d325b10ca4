"""The Llama family: Llama 2/3, SmolLM, and (through small subclasses) Mistral and Qwen2.

The model works on a flat run of tokens from many sequences ([T] ids and
positions); attention storage is behind `self.attn`, set by the runner.
q/k/v and gate/up projections are fused at load time so each is one matmul.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.metadata import AttentionMetadata
from ..config import ModelConfig
from ..quant import kernels as qk
from ..quant.formats import QuantTensor
from .linear import Embedding, Linear
from .rope import RotaryEmbedding, apply_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op (fp32 accumulation inside) instead of six.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, qk_norm: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, 
                                bias=cfg.attention_bias if cfg.o_proj_bias is None else cfg.o_proj_bias)
        self.window = cfg.layer_windows[layer_idx] if cfg.layer_windows else None
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = cfg.attn_logit_softcapping
        # Qwen3, Gemma 3: an RMSNorm over each q and k head before rope.
        self.q_norm = qk_norm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = qk_norm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.attn = None  # set by the model runner: an attention backend layer

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                meta: AttentionMetadata, norm: nn.Module | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + o_proj(attention(norm(x)))."""
        qkv = self.qkv_proj.fused(x, norm=norm)
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv)
        # A pure decode step on the native paged backend: rope, the cache write and attention
        # in one call (the same values as the ops below).
        decode_qkv = getattr(self.attn, "decode_qkv", None)
        o = decode_qkv(qkv, rope, meta, self.num_heads, self.num_kv_heads) if decode_qkv else None
        if o is None:
            t = x.shape[0]
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            # Rotate q and k heads together: one set of rope ops per layer, not two.
            qk = apply_rope(qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim), *rope)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            o = self.attn(q, k, v, meta).reshape(t, self.q_size)
        return self.o_proj.fused(o, residual=residual)

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, self.q_size)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, self.kv_size)
        return torch.cat((q, k, v), dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + down(silu(gate) * up), gate|up = gate_up(norm(x))."""
        return self.down_proj.fused(self.gate_up_proj.fused(x, norm=norm, silu_mul=True), residual=residual)


class DecoderLayer(nn.Module):
    qk_norm: type[nn.Module] | None = None  # the per-head q/k norm, for families that have one

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, self.qk_norm)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # The norms and residual adds travel with the projections, which fold them into one
        # native call where they can (quantized weights, few rows).
        h = self.self_attn(rope, h, meta, norm=self.input_layernorm, residual=h)
        return self.mlp(h, norm=self.post_attention_layernorm, residual=h)


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name fragment -> (our parameter fragment, shard index)
    packed = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    layer_cls: type[nn.Module] = DecoderLayer
    norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # Sliding layers with their own rope (Gemma 3's local base frequency).
        self.rope_local = None
        if cfg.local_rope_theta is not None:
            self.rope_local = RotaryEmbedding(cfg.head_dim, max_positions, cfg.local_rope_theta,
                                              cfg.local_rope_scaling)
        # An uninitialised table: the checkpoint fills it. (nn.Embedding's own init draws
        # normal_ values, whose meta-device kernel imports sympy: 2 s of startup.)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size,
                                      _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def tie_weights(self) -> None:
        if not self.config.tie_word_embeddings:
            return
        if self.embed_tokens.qweight is not None:  # the head reads the same quantized blocks
            self.lm_head.set_quantized([self.embed_tokens.qweight])
        else:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed(input_ids)
        rope = self.rope.lookup(positions, h.dtype)
        local = self.rope_local.lookup(positions, h.dtype) if self.rope_local is not None else rope
        for layer in self.layers:
            h = layer(local if layer.self_attn.window is not None else rope, h, meta)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head.qparts is not None:  # float32 straight from the kernel: no bf16 ties
            return qk.matmul(hidden, self.lm_head.qparts, out_dtype=torch.float32)
        return self.lm_head(hidden).float()

    def attention_modules(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]

    # -- weights ----------------------------------------------------------
    def shard_sizes(self, fused: str) -> list[int]:
        a = self.layers[0].self_attn
        if fused == "qkv_proj":
            return [a.q_size, a.kv_size, a.kv_size]
        return [self.config.intermediate_size] * 2

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        """HF name -> (our name, shard index or None); None to skip."""
        if "rotary_emb" in name:
            return None
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        for frag, (ours, shard) in self.packed.items():
            if f".{frag}." in name:
                return name.replace(frag, ours), shard
        return name, None

    def expect_quantized(self, hf_names: set[str]) -> None:
        """Before materializing (the model is on the meta device): the weights named will
        arrive quantized, so their float parameters are dropped instead of allocated."""
        for hf_name in hf_names:
            mapped = self.map_weight_name(hf_name)
            if mapped is not None:
                module = self.get_submodule(mapped[0].rsplit(".", 1)[0])
                module.weight = None
        if self.config.tie_word_embeddings and self.embed_tokens.weight is None:
            self.lm_head.weight = None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantTensor]],
                     dtype: torch.dtype = torch.float32) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        seen_shards: dict[str, dict[int, QuantTensor | None]] = {}
        for hf_name, tensor in weights:
            mapped = self.map_weight_name(hf_name)
            if mapped is None:
                continue
            name, shard = mapped
            if isinstance(tensor, QuantTensor):
                self._place_quantized(name, shard, tensor, hf_name, dtype, seen_shards, loaded)
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {type(self).__name__}")
            if shard is None:
                _copy_checked(param, tensor, hf_name)
                loaded.add(name)
            else:
                sizes = self.shard_sizes(name.split(".")[-2])
                start = sum(sizes[:shard])
                _copy_checked(param.narrow(0, start, sizes[shard]), tensor, hf_name)
                seen_shards.setdefault(name, {})[shard] = None
                if len(seen_shards[name]) == len(sizes):
                    loaded.add(name)
        self.tie_weights()
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        expected = set(params) | {n for n in seen_shards} | loaded
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def _place_quantized(self, name: str, shard: int | None, qt: QuantTensor, hf_name: str,
                         dtype: torch.dtype, seen: dict, loaded: set[str]) -> None:
        module = self.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(module, Embedding):
            module.set_quantized(qt, dtype)
            loaded.add(name)
            return
        if not isinstance(module, Linear):
            raise ValueError(f"checkpoint tensor {hf_name!r} is quantized but {name} is not a linear weight")
        if shard is None:
            module.set_quantized([qt])
            loaded.add(name)
            return
        sizes = self.shard_sizes(name.split(".")[-2])
        if qt.shape != (sizes[shard], module.in_features):
            raise ValueError(f"weight {hf_name!r} has shape {qt.shape}, expected {(sizes[shard], module.in_features)}")
        parts = seen.setdefault(name, {})
        parts[shard] = qt
        if len(parts) == len(sizes):
            if any(p is None for p in parts.values()):
                raise ValueError(f"{name}: some shards are quantized and others are not")
            module.set_quantized([parts[i] for i in range(len(sizes))])  # one kernel call, no copy
            loaded.add(name)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
