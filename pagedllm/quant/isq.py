"""In-situ quantization (ISQ, as in mistral.rs): a safetensors model's linear weights are
quantized at load into GGUF block formats and run on the same kernels as GGUF files.

Weights stream through one tensor at a time, so loading holds the quantized model plus one
float tensor. Q8_0 and Q4_0 round exactly as llama.cpp's reference quantizers do (the tests
check them byte for byte against gguf-py's), and so do Q4_1, Q5_0 and Q5_1. The K-quants are our
own fits, simpler than llama.cpp's search (gguf-py has no K-quant quantizer to match; its
dequantizer checks the layout): Q4_K and Q5_K a min/max fit per 32 values with 6-bit scales and
mins, Q6_K a signed fit per 16 values with int8 scales.

A weight whose rows a type's blocks do not tile falls back, per tensor and logged, to the next
type that does, as llama.cpp's quantizer does (Q4_K's 256-value blocks -> Q5_0's 32).
mistral.rs's numeric form picks the type a CPU gets there: `--isq 4` is Q4_K, `--isq 5` Q5_K,
`--isq 6` Q6_K, `--isq 8` Q8_0.
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch

from . import kernels as qk
from .formats import FORMATS, QuantFormatError, QuantTensor

logger = logging.getLogger(__name__)

ISQ_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# mistral.rs's `--isq N` on a CPU: N bits -> the K-quant (or Q8_0) it resolves to there.
ISQ_BITS = {2: "Q2_K", 3: "Q3_K", 4: "Q4_K", 5: "Q5_K", 6: "Q6_K", 8: "Q8_0"}
# A type whose blocks do not tile a row falls back to this one (llama.cpp's choice for its K-quants).
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def check_isq_type(fmt: str) -> str:
    """The ISQ type `fmt` names: a type name, or mistral.rs's bit count (2-8)."""
    name = str(fmt).strip().upper()
    if name.isdigit():
        bits = int(name)
        if bits not in ISQ_BITS:
            raise ValueError(
                f"unsupported ISQ bit width {fmt!r}; mistral.rs's numeric form takes "
                f"{', '.join(map(str, ISQ_BITS))} (on a CPU: "
                f"{', '.join(f'{b} = {t}' for b, t in ISQ_BITS.items())})"
            )
        name = ISQ_BITS[bits]
        if name not in ISQ_TYPES:
            raise ValueError(
                f"--isq {bits} means {name} (mistral.rs's choice on a CPU), which pagedllm cannot "
                f"quantize to at load yet; supported: {', '.join(ISQ_TYPES)}, or 4, 5, 6 and 8"
            )
        return name
    if name not in ISQ_TYPES:
        raise ValueError(
            f"unsupported ISQ type {fmt!r}; supported: {', '.join(ISQ_TYPES)}, or a bit count "
            "4, 5, 6 or 8 as mistral.rs takes it"
        )
    return name


def isq_stream(
    weights: Iterator[tuple[str, torch.Tensor]], fmt: str, names: set[str]
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    fmt = check_isq_type(fmt)
    for name, t in weights:
        yield name, (quantize(t, fmt, name) if name in names else t)


def quantize(w: torch.Tensor, fmt: str, name: str = "weight") -> QuantTensor:
    """Quantize a float matrix [rows, cols] into `fmt` blocks."""
    fmt = check_isq_type(fmt)
    if w.dim() != 2:
        raise QuantFormatError(f"{name}: ISQ quantizes matrices; this tensor has shape {tuple(w.shape)}")
    rows, cols = w.shape
    vals = FORMATS[fmt][1]
    if cols % vals:
        back = FALLBACK.get(fmt)
        if back is not None and cols % FORMATS[back][1] == 0:
            logger.info(
                "%s: %d columns are not whole %s blocks of %d; quantized to %s instead", name, cols, fmt, vals, back
            )
            return quantize(w, back, name)
        fits = [t for t in ISQ_TYPES if cols % FORMATS[t][1] == 0]
        raise QuantFormatError(
            f"{name}: ISQ type {fmt} packs rows in blocks of {vals} values, but this weight has {cols} "
            f"columns; {'use ' + ' or '.join(fits) if fits else 'no ISQ type fits it'}"
        )
    x = w.detach().to(torch.float32).reshape(-1, vals)
    if not torch.isfinite(x).all():
        raise QuantFormatError(f"{name}: holds NaN or inf values; refusing to quantize it")
    blocks = {
        "Q8_0": _q8_0,
        "Q4_0": _q4_0,
        "Q4_1": _q4_1,
        "Q5_0": _q5_0,
        "Q5_1": _q5_1,
        "Q4_K": _q4_k,
        "Q5_K": _q5_k,
        "Q6_K": _q6_k,
    }[fmt](x)
    return QuantTensor(fmt, blocks.reshape(rows, -1).contiguous(), (rows, cols))


def bits_per_weight(fmt: str) -> float:
    _, vals, nbytes = FORMATS[fmt]
    return 8 * nbytes / vals


def requantize(w: QuantTensor, fmt: str, rows: int | None = None, name: str = "weight") -> QuantTensor:
    """w's first `rows` rows (None: all) quantized again as `fmt`, from the values w stands for,
    in chunks (a large head's float32 copy whole would be hundreds of MB); packed where w is.
    Rounding twice loses more than rounding once: for weights whose products only propose
    (a speculative draft's), not for output."""
    rows = w.shape[0] if rows is None else rows
    step = max(1, (1 << 24) // w.shape[1])  # rows per chunk: 64 MB of float32
    chunks = [
        quantize(qk.embedding(w, torch.arange(r, min(rows, r + step)), torch.float32), fmt, name)
        for r in range(0, rows, step)
    ]  # (a type that does not tile the rows falls back alike in each)
    out = QuantTensor(chunks[0].fmt, torch.cat([c.data for c in chunks]), (rows, w.shape[1]))
    return out.pack() if w.packed and out.can_pack else out


def _half_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (torch.round rounds them to even)."""
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _roundf(x * inv).to(torch.int8).view(torch.uint8)
    return torch.cat([_half_bytes(d), q], dim=1)


def _q4_0(x: torch.Tensor) -> torch.Tensor:
    imax = x.abs().argmax(dim=1, keepdim=True)
    d = x.gather(1, imax) / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(x * inv + 8.5).clamp(0, 15).to(torch.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat([_half_bytes(d), qs], dim=1)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """Values 0-31 of 32-value blocks -> their low nibbles, two a byte (element j and j + 16)."""
    return (q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)


def _high_bits(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of each of a block's 32 values, as a little-endian uint32 (Q5_0, Q5_1)."""
    bits = ((q >> 4) & 1).to(torch.int64) << torch.arange(32)
    return bits.sum(dim=1).to(torch.int32).reshape(-1, 1).view(torch.uint8)


def _q5_0(x: torch.Tensor) -> torch.Tensor:
    imax = x.abs().argmax(dim=1, keepdim=True)
    d = x.gather(1, imax) / -16
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(x * inv + 16.5).clamp(0, 31).to(torch.uint8)
    return torch.cat([_half_bytes(d), _high_bits(q), _nibbles(q)], dim=1)


def _min_max(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 / Q5_1: (d, min, codes) of a min/max fit with `levels` steps."""
    lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    d = (hi - lo) / levels
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc((x - lo) * inv + 0.5).clamp(0, levels).to(torch.uint8)
    return d, lo, q


def _q4_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, q = _min_max(x, 15)
    return torch.cat([_half_bytes(d), _half_bytes(lo), _nibbles(q)], dim=1)


def _q5_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, q = _min_max(x, 31)
    return torch.cat([_half_bytes(d), _half_bytes(lo), _high_bits(q), _nibbles(q)], dim=1)


def _k_scales_mins(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, ...]:
    """Q4_K / Q5_K: a min/max fit of each 32-value sub-block of 256-value blocks x [n, 256], with
    6-bit scales and mins under two float16 super-scales. (d16, dmin16, sc, m, codes [n, 8, 32])."""
    n = x.shape[0]
    sub = x.view(n, 8, 32)
    lo = sub.amin(dim=2).clamp(max=0)  # the format's offset is -dmin * m <= 0
    hi = sub.amax(dim=2)
    scale = (hi - lo) / levels
    mins = -lo
    d = scale.amax(dim=1, keepdim=True) / 63
    dmin = mins.amax(dim=1, keepdim=True) / 63
    d16, dmin16 = d.to(torch.float16), dmin.to(torch.float16)
    dq, dminq = d16.float(), dmin16.float()
    # A sub-block with any spread keeps a scale of at least 1: rounding it to 0 would flatten it.
    sc = torch.where(dq > 0, torch.round(scale / dq.clamp(min=1e-30)), 0).clamp(0, 63)
    sc = torch.where(scale > 0, sc.clamp(min=1), sc)
    m = torch.where(dminq > 0, torch.round(mins / dminq.clamp(min=1e-30)), 0).clamp(0, 63)
    s_eff = (dq * sc).unsqueeze(2)
    m_eff = (dminq * m).unsqueeze(2)
    q = torch.where(s_eff > 0, torch.round((sub + m_eff) / s_eff.clamp(min=1e-30)), 0).clamp(0, levels)
    return d16, dmin16, sc.to(torch.uint8), m.to(torch.uint8), q.to(torch.uint8)


def _k_header(d16: torch.Tensor, dmin16: torch.Tensor, sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """d, dmin and the 12 bytes of 6-bit scales and mins that Q4_K and Q5_K share."""
    n = sc.shape[0]
    packed = torch.cat(
        [
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
        ],
        dim=1,
    )
    return torch.cat([d16.view(torch.uint8).reshape(n, 2), dmin16.view(torch.uint8).reshape(n, 2), packed], dim=1)


def _k_low_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes [n, 8, 32] -> 128 bytes: sub-blocks 2c and 2c + 1 share bytes 32c.., low and high nibble."""
    q = (q & 15).view(q.shape[0], 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(q.shape[0], 128)


def _q4_k(x: torch.Tensor) -> torch.Tensor:
    d16, dmin16, sc, m, q = _k_scales_mins(x, 15)
    return torch.cat([_k_header(d16, dmin16, sc, m), _k_low_nibbles(q)], dim=1)


def _q5_k(x: torch.Tensor) -> torch.Tensor:
    d16, dmin16, sc, m, q = _k_scales_mins(x, 31)
    # Bit 4 of value l of sub-block s is bit s of byte l of the 32 high-bit bytes.
    qh = (((q >> 4) & 1) << torch.arange(8, dtype=torch.uint8).view(1, 8, 1)).sum(dim=1, dtype=torch.uint8)
    return torch.cat([_k_header(d16, dmin16, sc, m), qh, _k_low_nibbles(q)], dim=1)


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    """A signed fit per 16 values (the largest magnitude maps to -32), int8 scales under one
    float16 super-scale. Layout: 128 bytes of low nibbles, 64 of high bit pairs, 16 scales, d."""
    n = x.shape[0]
    sub = x.view(n, 16, 16)
    imax = sub.abs().argmax(dim=2, keepdim=True)
    scale = sub.gather(2, imax)[:, :, 0] / -32
    smax = scale.gather(1, scale.abs().argmax(dim=1, keepdim=True))
    d16 = (smax / -128).to(torch.float16)
    dq = d16.float()
    sc = torch.where(dq != 0, torch.round(scale / torch.where(dq != 0, dq, 1)), 0).clamp(-128, 127)
    s_eff = (dq * sc).unsqueeze(2)
    q = torch.where(s_eff != 0, torch.round(sub / torch.where(s_eff != 0, s_eff, 1)), 0).clamp(-32, 31)
    q = (q + 32).to(torch.uint8).view(n, 2, 4, 32)  # [half of 128, quarter j, l]: value 128h + 32j + l
    ql = torch.cat(
        [(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], dim=2
    ).reshape(n, 128)
    hi = q >> 4
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    scales = sc.to(torch.int8).view(torch.uint8)
    return torch.cat([ql, qh, scales, d16.view(torch.uint8).reshape(n, 2)], dim=1)
