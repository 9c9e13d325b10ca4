"""KV-cache quantization: how K and V are stored in the cache, and read back.

The modes (`CacheConfig.kv_cache_dtype`):

- ``auto``: the model's compute dtype, no scales.
- ``bf16``, ``f16``: values rounded to bfloat16 / float16, no scales (llama.cpp's default
  cache is f16). Under float32 compute (a CPU without bf16 instructions) they halve the
  cache; attention reads them widened to float32. ``f16`` holds 11 significant bits in
  a range of +-65504, ``bf16`` 8 bits in float32's range.
- ``int8``: symmetric int8 with one float32 scale per (token, kv head):
  ``scale = amax(|x|) over head_dim / 127``. The scale is computed from the
  values as they are written, so nothing is calibrated and nothing saturates.
  Scales live beside the pages, ``[num_blocks, block_size, num_kv_heads]`` per
  layer for K and for V (KIVI / KVQuant report per-token scales as nearly
  lossless at 8 bits).
- ``f8e4m3``: ``torch.float8_e4m3fn`` values with one float32 scale per
  (layer, kv head) for K and for V, fixed for the engine's life so a block
  written once stays valid (prefix cache, preemption). The scales come from the
  checkpoint when it has them (``k_scale``/``v_scale``), else from a
  calibration pass at load (see `kv/calibration.py`). Values beyond
  ``448 * scale`` saturate to +-448: never inf or NaN.

A scale is always the *dequantization* scale: ``x ~= stored * scale``.

Reading is fused into the gather: the attention path gathers the stored blocks
(1 byte a value) and their scales, and converts only those into the compute
dtype. float8 -> bfloat16/float32 conversion is scalar (slow) on CPU, so f8
values are reinterpreted bit-wise instead (see `_fp8_as`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import KV_CACHE_DTYPES, normalize_kv_cache_dtype

logger = logging.getLogger(__name__)

INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BYTES = 4  # scales are float32
# f8e4m3 scales must keep `scale * 2**120` finite in bfloat16/float32 (see `_fp8_as`).
FP8_SCALE_MAX = 2.0**7
FP8_SCALE_MIN = 2.0**-100


@dataclass(frozen=True)
class KVQuantMode:
    """What one `kv_cache_dtype` means for storage and memory."""

    name: str  # auto | bf16 | f16 | f8e4m3 | int8
    quant_mode: str  # how values are mapped, for the trace
    scale_granularity: str  # none | per-layer-head | per-token-head
    storage_dtype: torch.dtype | None  # None: the compute dtype

    def storage(self, compute_dtype: torch.dtype) -> torch.dtype:
        return self.storage_dtype or compute_dtype

    @property
    def quantized(self) -> bool:
        """Stored values may differ from the computed ones (a storage dtype of its own)."""
        return self.storage_dtype is not None

    @property
    def scaled(self) -> bool:
        """Stored with scales (int8, f8e4m3), not as a plain float dtype."""
        return self.scale_granularity != "none"

    @property
    def token_scales(self) -> bool:
        return self.scale_granularity == "per-token-head"

    @property
    def head_scales(self) -> bool:
        return self.scale_granularity == "per-layer-head"

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype) -> int:
        """K and V of one token in every layer, with the per-token scales."""
        elem = torch.empty((), dtype=self.storage(compute_dtype)).element_size()
        n = 2 * num_layers * num_kv_heads * head_dim * elem
        if self.token_scales:
            n += 2 * num_layers * num_kv_heads * SCALE_BYTES
        return n

    def fixed_bytes(self, num_layers: int, num_kv_heads: int) -> int:
        """Memory that does not grow with tokens: the per-(layer, head) scales."""
        return 2 * num_layers * num_kv_heads * SCALE_BYTES if self.head_scales else 0


MODES: dict[str, KVQuantMode] = {
    "auto": KVQuantMode("auto", "none", "none", None),
    "bf16": KVQuantMode("bf16", "bf16-round", "none", torch.bfloat16),
    "f16": KVQuantMode("f16", "fp16-round", "none", torch.float16),
    "f8e4m3": KVQuantMode("f8e4m3", "fp8-e4m3-static-scale", "per-layer-head", torch.float8_e4m3fn),
    "int8": KVQuantMode("int8", "int8-symmetric-absmax", "per-token-head", torch.int8),
}
assert tuple(MODES) == KV_CACHE_DTYPES


def get_mode(name: object) -> KVQuantMode:
    """The mode for a `kv_cache_dtype` value (a string or an enum with a string value)."""
    key = normalize_kv_cache_dtype(name)
    if key not in MODES:
        raise ValueError(f"kv_cache_dtype={name!r} is not supported; use one of {'|'.join(KV_CACHE_DTYPES)}")
    return MODES[key]


# -- int8, per (token, head) ---------------------------------------------
def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], float32 scale [...]) with x ~= q * scale.

    Round to nearest, so |x - q * scale| <= scale / 2 = amax / 254 per element."""
    xf = x.float()
    scale = xf.abs().amax(-1) / INT8_MAX
    # An all-zero vector gets scale 0 and reads back as zeros.
    q = (xf / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)).round_()
    return q.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., D] int8, scale [...] -> [..., D] in `dtype`.

    int8 -> bfloat16 is exact; the scale is rounded to `dtype` once per (token, head),
    which costs less than the int8 rounding itself and keeps the multiply in `dtype`."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    out.copy_(q)
    return out.mul_(scale.to(dtype).unsqueeze(-1))


# -- f8e4m3, per (layer, head) -------------------------------------------
def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., H, D], scale [H] float32 -> float8_e4m3fn [..., H, D], saturating at +-448."""
    y = x.float() / scale.unsqueeze(-1)
    return y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


# e4m3's exponent field (bias 7) copied into another format's exponent field gives a
# number 2**(7 - bias) times the e4m3 value, subnormals included: (shift, int dtype, factor).
_FP8_BITS = {
    torch.bfloat16: (4, torch.int16, 2.0**120),
    torch.float16: (7, torch.int16, 2.0**8),
    torch.float32: (20, torch.int32, 2.0**120),
}


def _fp8_as(q: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """(t, factor) with t in `dtype` and t * factor == q exactly, by moving bits.

    torch's float8 -> float conversion on CPU is element by element (about 5x slower
    than these three vectorized integer passes)."""
    shift, itype, factor = _FP8_BITS[dtype]
    bits = torch.iinfo(itype).bits
    # Keep the shifted exponent+mantissa and the top (sign) bit, as a signed mask.
    mask = ((1 << (bits - 1)) | (0x7F << shift)) - (1 << bits)
    i = q.view(torch.int8).to(itype)  # sign-extended: after the shift the top bit is the sign
    i.bitwise_left_shift_(shift)
    i.bitwise_and_(mask)
    return i.view(dtype), factor


def fp8_multiplier(scale: torch.Tensor, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
    """[H, D] in `dtype`: what `_fp8_as(q, dtype)[0]` is multiplied by to read the real values
    (a full [H, D] operand multiplies faster than a broadcast [H, 1] one)."""
    factor = _FP8_BITS[dtype][2] if dtype in _FP8_BITS else 1.0
    return (scale.float() * factor).to(dtype)[:, None].expand(-1, head_dim).contiguous()


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, multiplier: torch.Tensor | None = None
) -> torch.Tensor:
    """q [..., H, D] float8_e4m3fn, scale [H] -> [..., H, D] in `dtype`."""
    mult = multiplier if multiplier is not None else fp8_multiplier(scale, dtype, q.shape[-1])
    if dtype not in _FP8_BITS:
        return q.to(dtype).mul_(mult)
    return _fp8_as(q, dtype)[0].mul_(mult)


def check_fp8_scales(scales: torch.Tensor, what: str) -> torch.Tensor:
    """Float32 scales, validated: finite and within the range the bit-wise read supports."""
    s = scales.detach().float()
    if not torch.isfinite(s).all() or (s <= 0).any():
        raise ValueError(f"{what}: f8e4m3 KV scales must be finite and > 0")
    if (s > FP8_SCALE_MAX).any():
        raise ValueError(
            f"{what}: f8e4m3 KV scale {s.max().item():g} is above {FP8_SCALE_MAX:g} "
            f"(values up to {FP8_SCALE_MAX * FP8_MAX:g}); not supported"
        )
    return s.clamp_min(FP8_SCALE_MIN)


# -- one layer's codec ----------------------------------------------------
class KVCodec:
    """Quantize on write, dequantize on read, for one layer of one cache.

    For f8e4m3 it holds the layer's per-head scales [2, H] (K, V); the per-dtype
    multipliers used on read are computed once."""

    def __init__(self, mode: KVQuantMode, head_scales: torch.Tensor | None = None) -> None:
        if mode.head_scales and head_scales is None:
            raise ValueError("f8e4m3 needs per-head scales")
        self.mode = mode
        self.head_scales = head_scales  # [2, H] float32 or None
        self._mult: dict[tuple, torch.Tensor] = {}  # (kv, dtype, head_dim) -> f8 read multiplier

    def encode(self, x: torch.Tensor, kv: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, H, D] of K (kv=0) or V (kv=1) -> (stored values, per-token scales [T, H] or None)."""
        name = self.mode.name
        if name == "int8":
            return quantize_int8(x)
        if name == "f8e4m3":
            return quantize_fp8(x, self.head_scales[kv]), None
        return x, None

    def decode(self, data: torch.Tensor, token_scale: torch.Tensor | None, kv: int, dtype: torch.dtype) -> torch.Tensor:
        """Stored values [..., H, D] (+ their [..., H] scales) -> `dtype`."""
        name = self.mode.name
        if name == "int8":
            return dequantize_int8(data, token_scale, dtype)
        if name == "f8e4m3":
            key = (kv, dtype, data.shape[-1])
            mult = self._mult.get(key)
            if mult is None:
                mult = self._mult[key] = fp8_multiplier(self.head_scales[kv], dtype, data.shape[-1])
            return dequantize_fp8(data, self.head_scales[kv], dtype, mult)
        return data if data.dtype == dtype else data.to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of float8 storage: index_copy_/index_put_ have no float8 kernels on CPU."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
