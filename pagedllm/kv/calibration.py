"""Per-(layer, kv head) scales for the f8e4m3 KV cache: from the checkpoint, else calibrated.

Checkpoints quantized for an fp8 KV cache (vLLM / llm-compressor style) carry
`layers.N.self_attn.k_scale` / `v_scale` (or one `kv_scale`, or
`k_proj.output_scale` / `v_proj.output_scale`): dequantization scales, a scalar
or one per kv head. The loader sets them aside (`LoadedModel.kv_scales`).

Without them the scales are calibrated once at load, not from the first
request: the cache must not depend on which request came first, and a scale
that changed later would invalidate blocks already written (prefix cache,
preemption). The model runs a fixed English paragraph (a normal prefill, no
KV cache) while each layer records amax(|K|) and amax(|V|) per kv head; then

    scale = 2 ** ceil(log2(amax * HEADROOM / 448))

HEADROOM = 16 plus the rounding up to a power of two leaves 16x-32x above the
calibration maximum before values saturate (they clamp to +-448, never
inf/NaN). One paragraph is a small sample: longer text goes well past its V
maximum, and a smaller headroom let a head saturate and cost perplexity
(docs/benchmarks/from-code.md, "f8e4m3 calibration headroom"). The headroom costs
nothing measurable in precision: e4m3 keeps 3
mantissa bits over its whole normal range, which at this scale still reaches
down to amax / 900, and below it the subnormals' absolute error (amax * 7e-5 at
most) is a thousandth of the top values'. A power-of-two scale also makes the
dequantizing multiply exact.

The forward that records the amax runs the model with an observing attention layer, so it
lives with the attention layers (attention/calibration.py); this module is the arithmetic.
"""

from __future__ import annotations

import logging
import re

import torch

from .quant import FP8_MAX, FP8_SCALE_MAX, FP8_SCALE_MIN, check_fp8_scales

logger = logging.getLogger(__name__)

HEADROOM = 16.0
CALIBRATION_TEXT = (
    "It was a bright cold day in early spring, and the market square was already full of people. "
    "Merchants called out the prices of apples, bread and wool, while children ran between the "
    "stalls. An old man sat by the fountain reading a letter twice, as if the words might change. "
    '"We will need more flour before the end of the week," said the baker to his daughter, who '
    "wrote the numbers carefully in a small book: 12 sacks, 3 barrels of oil, 250 eggs. "
    "Across the river, the new bridge was nearly finished; engineers argued about the last "
    "arch, and the mayor promised a celebration with music, speeches and fireworks. "
    "Questions remained. Who would pay for it? How long would it last? Nobody knew, yet "
    "everyone agreed that the town had not looked so hopeful in years."
)

# HF checkpoint names of KV-cache scales -> (layer, which): which 0 = K, 1 = V, 2 = both.
_SCALE_NAMES = [
    re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.)?(k|v|kv)_scale$"),
    re.compile(r"layers\.(\d+)\.self_attn\.(k|v)_proj\.output_scale$"),
]
_WHICH = {"k": 0, "v": 1, "kv": 2}


def kv_scale_key(name: str) -> tuple[int, int] | None:
    """(layer, 0=K / 1=V / 2=both) when `name` is a KV-cache scale tensor, else None."""
    for rx in _SCALE_NAMES:
        m = rx.search(name)
        if m:
            return int(m.group(1)), _WHICH[m.group(2)]
    return None


def checkpoint_fp8_scales(
    kv_scales: dict[tuple[int, int], torch.Tensor], num_layers: int, num_kv_heads: int
) -> torch.Tensor | None:
    """[num_layers, 2, H] from the checkpoint's scales, or None unless every layer has K and V."""
    if not kv_scales:
        return None
    out = torch.empty(num_layers, 2, num_kv_heads)
    for layer in range(num_layers):
        for kv in (0, 1):
            t = kv_scales.get((layer, kv), kv_scales.get((layer, 2)))
            if t is None:
                logger.warning(
                    "checkpoint has KV scales for some layers but not K/V of layer %d: "
                    "calibrating all f8e4m3 scales instead",
                    layer,
                )
                return None
            t = t.detach().float().reshape(-1)
            if t.numel() not in (1, num_kv_heads):
                raise ValueError(
                    f"layer {layer}: KV scale has {t.numel()} values; expected 1 or {num_kv_heads} (one per kv head)"
                )
            out[layer, kv] = t.expand(num_kv_heads) if t.numel() == 1 else t
    return check_fp8_scales(out, "checkpoint")


def scales_from_amax(amax: torch.Tensor, headroom: float = HEADROOM) -> torch.Tensor:
    """Power-of-two dequantization scales that map amax * headroom into e4m3's range."""
    a = amax.double() * headroom / FP8_MAX
    exp = torch.where(a > 0, torch.ceil(torch.log2(a.clamp_min(1e-300))), torch.zeros_like(a))
    s = torch.pow(2.0, exp).clamp(FP8_SCALE_MIN, FP8_SCALE_MAX)
    return s.float()


def calibration_ids(tokenizer, vocab: int) -> list[int]:
    """The calibration paragraph's token ids (any ids where the tokenizer cannot encode it)."""
    try:
        ids = list(tokenizer.encode(CALIBRATION_TEXT))
    except Exception:  # a tokenizer that cannot encode plain text: any ids exercise the layers
        logger.warning("calibration text could not be tokenized; calibrating on token ids 0..127")
        ids = []
    if len(ids) < 16:
        ids = list(range(128))
    return [t % vocab for t in ids]


__all__ = [
    "scales_from_amax",
    "checkpoint_fp8_scales",
    "kv_scale_key",
    "calibration_ids",
    "HEADROOM",
    "CALIBRATION_TEXT",
]
