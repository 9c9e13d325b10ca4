"""Rotary position embeddings with the scalings Llama-family checkpoints use."""

from __future__ import annotations

import math

import torch


def inv_frequencies(
    head_dim: int, theta: float, scaling: dict | None, max_positions: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention factor applied to cos/sin."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv = 1.0 / (theta**exponents)
    if not scaling:
        return inv, 1.0
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv, scaling), 1.0
    if kind in ("longrope", "su"):
        return _longrope(theta**exponents, scaling, max_positions)
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: linear, llama3, longrope)")


def _longrope(wavelengths: torch.Tensor, s: dict, max_positions: int | None) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-frequency divisors, the long ones when the context may pass the
    pretraining length. transformers switches per forward call (and recomputes the cache when
    a sequence crosses it); like llama.cpp we choose once, by the engine's max_model_len, so
    every position of a sequence is rotated the same way. Below the pretraining length that
    equals transformers exactly."""
    orig = int(s["original_max_position_embeddings"])
    factor = float(s.get("factor") or 1.0)
    attn = s.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    long = max_positions is not None and max_positions > orig
    ext = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
    if ext.numel() != wavelengths.numel():
        raise ValueError(f"longrope has {ext.numel()} factors for {wavelengths.numel()} rope frequencies")
    return 1.0 / (ext * wavelengths), float(attn)


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin per position; applied in the rotate-half (GPT-NeoX) layout."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.args = (head_dim, max_positions, theta, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        # On the meta device (the loader builds there, then calls reset_buffers on the real
        # device) the tables would be thrown away, and arange/pow there import sympy (~1 s).
        if not self.cos.is_meta:
            self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the tables; called again after the model is materialised from meta."""
        head_dim, max_positions, theta, scaling = self.args
        inv, attn_factor = inv_frequencies(head_dim, theta, scaling, max_positions)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv.to(t.device))
        self.cos = freqs.cos() * attn_factor
        self.sin = freqs.sin() * attn_factor

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the batch's positions, [T, 1, D/2]: computed once per step, used by every layer."""
        cos, sin = self._tables(dtype)
        return cos.index_select(0, positions).unsqueeze(1), sin.index_select(0, positions).unsqueeze(1)

    def _tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables rounded to `dtype` once (the same values as rounding the rows looked up:
        a decode step then makes two small ops, not four, each a fixed cost). Made again
        when the float32 tables are replaced (reset_buffers, a move to another device)."""
        key = (dtype, self.cos.device, self.cos.data_ptr(), self.sin.data_ptr())
        cached = self.__dict__.get("_rounded")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_rounded"] = (key, self.cos.to(dtype), self.sin.to(dtype))
        return cached[1], cached[2]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] in the rotate-half layout."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2.5-VL): each token has three positions, (temporal, height, width), and the
    head's rope frequencies are cut into three sections (`sections`, counts of frequencies),
    each rotated by its own stream. Positions [T] are one stream for all three (text: plain
    rope, the same tables); positions [3, T] give each stream its own."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, sections: list[int]
    ) -> None:
        if sum(sections) != head_dim // 2:
            raise ValueError(
                f"mrope_section {sections} must add up to head_dim / 2 = {head_dim // 2} (rope frequencies per head)"
            )
        super().__init__(head_dim, max_positions, theta, scaling)
        self.sections = list(sections)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().lookup(positions, dtype)
        out = []
        for table in (self.cos, self.sin):
            rows = table[positions]  # [3, T, D/2]: each stream's angles
            parts = rows.split(self.sections, dim=-1)
            out.append(torch.cat([p[i % 3] for i, p in enumerate(parts)], dim=-1).unsqueeze(1).to(dtype))
        return out[0], out[1]
