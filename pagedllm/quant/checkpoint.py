"""Quantized safetensors checkpoints: GPTQ, AWQ (GEMM layout) and compressed-tensors
`pack-quantized`, read from the folder's `quantization_config` and repacked at load, losslessly,
into the GGUF block formats the native kernels run.

All three store, per weight, integer codes q (4 or 8 bits), a scale s and an integer zero z per
group of columns of a row, and mean w = s * (q - z). A 32-value block of Q4_0 means d * (c - 8),
of Q5_0 d * (c - 16) and of Q8_0 d * c: with d = s (fp16, as the checkpoints store it) and
c = q - z + offset the same numbers come out bit for bit, as long as q - z fits the block's
range. The zeros alone bound it, so each weight's format is chosen before its codes are read:
Q4_0 where every zero is the symmetric midpoint (8 of 4 bits), Q5_0 for other 4-bit zeros
(q - z lies in [-16, 15]), Q8_0 for 8 bits with the midpoint 128; anything else (8-bit
asymmetric, group sizes that are not a multiple of 32, scales fp16 cannot hold) is loaded as a
float weight, logged. A group of 64 or 128 columns gives its scale to each of its 32-value blocks.

`desc_act` (GPTQ) and activation ordering (compressed-tensors' `actorder: group`) assign columns
to groups by `g_idx`, out of order. The repacked weight holds the columns sorted by group, and
the layer permutes its input's columns to match, once per call (models/linear.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .formats import QuantFormatError, QuantTensor

logger = logging.getLogger(__name__)

METHODS = ("gptq", "awq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of a word holds column AWQ_ORDER[i]


@dataclass
class Scheme:
    """What a checkpoint's quantization_config says about its weights."""

    method: str
    bits: int
    group_size: int  # -1: one group per row
    sym: bool
    zero_plus_one: bool = False  # GPTQ v1: the stored zeros are z - 1
    marker: str = "qweight"  # the suffix that names a quantized weight's codes
    parts: tuple[str, ...] = ()  # every suffix a quantized weight's tensors may carry

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"{self.method} {self.bits}-bit {group} {'sym' if self.sym else 'asym'}"


def read_scheme(qcfg: dict) -> Scheme:
    """The scheme of `quantization_config` (config.json), or a QuantFormatError naming the key."""
    method = str(qcfg.get("quant_method", "")).lower()
    if method == "gptq":
        bits, gs = _bits(qcfg, "bits", method), int(qcfg.get("group_size", -1))
        fmt = str(qcfg.get("checkpoint_format", qcfg.get("format", "gptq"))).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantFormatError(
                f"quantization_config.checkpoint_format = {fmt!r} is not supported; "
                "GPTQ checkpoints load in the gptq (v1) and gptq_v2 formats"
            )
        return Scheme(
            "gptq",
            bits,
            gs,
            bool(qcfg.get("sym", True)),
            zero_plus_one=fmt == "gptq",
            parts=("qweight", "qzeros", "scales", "g_idx"),
        )
    if method == "awq":
        version = str(qcfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantFormatError(
                f"quantization_config.version = {version!r} is not supported; AWQ checkpoints load in the GEMM layout"
            )
        bits = _bits(qcfg, "bits" if "bits" in qcfg else "w_bit", method)
        if bits != 4:
            raise QuantFormatError(f"quantization_config.bits = {bits}: AWQ's GEMM layout packs 4-bit codes")
        gs = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
        return Scheme("awq", bits, gs, not bool(qcfg.get("zero_point", True)), parts=("qweight", "qzeros", "scales"))
    if method == "compressed-tensors":
        return _ct_scheme(qcfg)
    raise QuantFormatError(
        f"quantization_config.quant_method = {qcfg.get('quant_method')!r} is not supported; "
        f"pagedllm loads {', '.join(METHODS)} (pack-quantized) checkpoints, or use a GGUF "
        "file or float weights"
    )


def _bits(qcfg: dict, key: str, method: str) -> int:
    bits = int(qcfg.get(key, 4))
    if bits not in (4, 8):
        raise QuantFormatError(f"quantization_config.{key} = {bits}: {method} checkpoints load with 4 or 8 bits")
    return bits


def _ct_scheme(qcfg: dict) -> Scheme:
    fmt = qcfg.get("format")
    groups = qcfg.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantFormatError(
            f"quantization_config.config_groups has {len(groups)} groups; pagedllm loads "
            "compressed-tensors checkpoints with one scheme for every linear layer"
        )
    ((gname, group),) = groups.items()
    fmt = group.get("format", fmt)
    if fmt != "pack-quantized":
        raise QuantFormatError(
            f"quantization_config.format = {fmt!r} is not supported; compressed-tensors "
            "checkpoints load in the pack-quantized (W4A16, W8A16) format"
        )
    w = group.get("weights") or {}
    if group.get("input_activations"):
        raise QuantFormatError(
            f"quantization_config.config_groups.{gname}.input_activations is set; only "
            "weight-only schemes (W4A16, W8A16) are supported"
        )
    if w.get("type", "int") != "int":
        raise QuantFormatError(
            f"quantization_config.config_groups.{gname}.weights.type = {w.get('type')!r}; "
            "only int weights are supported"
        )
    bits = int(w.get("num_bits", 4))
    if bits not in (4, 8):
        raise QuantFormatError(
            f"quantization_config.config_groups.{gname}.weights.num_bits = {bits}: "
            "compressed-tensors checkpoints load with 4 or 8 bits"
        )
    strategy = w.get("strategy", "group")
    if strategy not in ("group", "channel"):
        raise QuantFormatError(
            f"quantization_config.config_groups.{gname}.weights.strategy = {strategy!r}; "
            "group and channel are supported"
        )
    gs = int(w.get("group_size") or -1) if strategy == "group" else -1
    return Scheme(
        "compressed-tensors",
        bits,
        gs,
        bool(w.get("symmetric", True)),
        marker="weight_packed",
        parts=("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
    )


@dataclass
class Unpacked:
    """One weight's integers, in the checkpoint's column order: w = scales * (codes - zeros)."""

    name: str  # the checkpoint prefix, for messages
    codes: torch.Tensor  # uint8 [out, in], unsigned
    zeros: torch.Tensor  # int16 [out, groups], unsigned (v1's +1 applied)
    scales: torch.Tensor  # [out, groups], as stored (fp16 / bf16 / fp32)
    g_idx: torch.Tensor | None  # int64 [in]: each column's group; None: contiguous groups
    perm: torch.Tensor | None = field(default=None, repr=False)

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def column_groups(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.codes.shape[1]) // self.group_size

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in] in the checkpoint's column order (the reference; exact for fp16 scales)."""
        g = self.column_groups()
        return (self.codes.int() - self.zeros[:, g].int()).float() * self.scales[:, g].float()


def _unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [r, c] with 32/bits codes per word, lowest bits first -> uint8 [r, c * 32/bits]."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=packed.dtype, device=packed.device)
    vals = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0], packed.shape[1] * per).to(torch.uint8)


def _need(tensors: dict[str, torch.Tensor], prefix: str, suffix: str, why: str) -> torch.Tensor:
    t = tensors.get(suffix)
    if t is None:
        raise QuantFormatError(f"{prefix}.{suffix} is missing; {why}")
    return t


def unpack(scheme: Scheme, prefix: str, tensors: dict[str, torch.Tensor]) -> Unpacked:
    """A weight's integers from its checkpoint tensors (suffix -> tensor), checked."""
    if scheme.method == "gptq":
        return _unpack_gptq(scheme, prefix, tensors)
    if scheme.method == "awq":
        return _unpack_awq(scheme, prefix, tensors)
    return _unpack_ct(scheme, prefix, tensors)


def _int32(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype not in (torch.int32, torch.uint32):
        raise QuantFormatError(f"{name} is {t.dtype}; packed codes are int32")
    return t.view(torch.int32)


def _unpack_gptq(scheme: Scheme, prefix: str, tensors: dict[str, torch.Tensor]) -> Unpacked:
    why = "a GPTQ weight needs qweight, qzeros and scales"
    qweight = _int32(_need(tensors, prefix, "qweight", why), f"{prefix}.qweight")
    qzeros = _int32(_need(tensors, prefix, "qzeros", why), f"{prefix}.qzeros")
    scales = _need(tensors, prefix, "scales", why)
    codes = _unpack_cols(qweight.t().contiguous(), scheme.bits)  # [out, in]
    out, cols = codes.shape
    if scheme.zero_plus_one:  # v1 wrote z - 1 by subtracting 0x11111111 from the packed words: undo it so
        ones = sum(1 << s for s in range(0, 32, scheme.bits))  # (a zero of 0 borrowed from its neighbour)
        qzeros = (qzeros.long() + ones) & 0xFFFFFFFF
    zeros = _unpack_cols(qzeros, scheme.bits)[:, :out].to(torch.int16)  # [groups, out]
    return _checked(
        scheme, prefix, "qweight", codes, zeros.t().contiguous(), scales.t().contiguous(), tensors.get("g_idx")
    )


def _unpack_awq(scheme: Scheme, prefix: str, tensors: dict[str, torch.Tensor]) -> Unpacked:
    qweight = _int32(_need(tensors, prefix, "qweight", "an AWQ weight needs qweight and scales"), f"{prefix}.qweight")
    scales = _need(tensors, prefix, "scales", "an AWQ weight needs qweight and scales")
    order = torch.tensor(AWQ_ORDER).argsort()  # column c of a word sits in nibble order[c]

    def unpack_awq(t: torch.Tensor) -> torch.Tensor:
        v = _unpack_cols(t, 4).view(t.shape[0], t.shape[1], 8)
        return v[:, :, order].reshape(t.shape[0], -1)

    codes = unpack_awq(qweight).t().contiguous()  # [out, in]
    if scheme.sym:
        zeros = torch.full(scales.shape, 8, dtype=torch.int16)
    else:
        qzeros = _int32(
            _need(tensors, prefix, "qzeros", "an AWQ weight with zero_point needs qzeros"), f"{prefix}.qzeros"
        )
        zeros = unpack_awq(qzeros).to(torch.int16)
    return _checked(scheme, prefix, "qweight", codes, zeros.t().contiguous(), scales.t().contiguous(), None)


def _unpack_ct(scheme: Scheme, prefix: str, tensors: dict[str, torch.Tensor]) -> Unpacked:
    why = "a pack-quantized weight needs weight_packed, weight_scale and weight_shape"
    packed = _int32(_need(tensors, prefix, "weight_packed", why), f"{prefix}.weight_packed")
    scales = _need(tensors, prefix, "weight_scale", why)
    shape = [int(v) for v in _need(tensors, prefix, "weight_shape", why).tolist()]
    if len(shape) != 2 or shape[0] != packed.shape[0] or not 0 < shape[1] <= packed.shape[1] * 32 // scheme.bits:
        raise QuantFormatError(f"{prefix}.weight_shape = {shape} does not match weight_packed {tuple(packed.shape)}")
    out, cols = shape
    codes = _unpack_cols(packed, scheme.bits)[:, :cols]  # signed + 2^(bits-1), as pack_to_int32 stores them
    if scheme.sym:
        zeros = torch.full(scales.shape, 1 << (scheme.bits - 1), dtype=torch.int16)
    else:
        zp = _int32(
            _need(tensors, prefix, "weight_zero_point", "an asymmetric scheme needs weight_zero_point"),
            f"{prefix}.weight_zero_point",
        )
        zeros = _unpack_cols(zp.t().contiguous(), scheme.bits)[:, :out].t().to(torch.int16)  # packed along rows
    if scales.dim() == 1:
        scales = scales.unsqueeze(1)
    return _checked(scheme, prefix, "weight_packed", codes, zeros.contiguous(), scales, tensors.get("weight_g_idx"))


def _checked(
    scheme: Scheme,
    prefix: str,
    marker: str,
    codes: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
) -> Unpacked:
    out, cols = codes.shape
    groups = scales.shape[1] if scales.dim() == 2 else 0
    gs = cols if scheme.group_size == -1 else scheme.group_size
    if gs <= 0 or cols % gs:
        raise QuantFormatError(
            f"{prefix}.{marker}: group_size {scheme.group_size} (quantization_config) does not "
            f"divide its {cols} input columns"
        )
    if scales.shape != (out, cols // gs) and not (scheme.group_size == -1 and scales.shape == (out, 1)):
        raise QuantFormatError(
            f"{prefix} scales have shape {tuple(scales.shape)}, expected {(out, cols // gs)} "
            f"for a {out}x{cols} weight in groups of {gs}"
        )
    if zeros.shape != scales.shape:
        raise QuantFormatError(f"{prefix} zeros have shape {tuple(zeros.shape)}, expected {tuple(scales.shape)}")
    if g_idx is not None:
        g_idx = g_idx.long()
        groups = scales.shape[1]
        if (
            g_idx.shape != (cols,)
            or g_idx.min() < 0
            or g_idx.max() >= groups
            or not bool((torch.bincount(g_idx, minlength=groups) == cols // groups).all())
        ):
            name = "g_idx" if scheme.method == "gptq" else "weight_g_idx"
            raise QuantFormatError(
                f"{prefix}.{name} is not a permutation of groups: each of the {groups} groups "
                f"must hold {cols // groups} of the {cols} columns"
            )
        if bool((g_idx == torch.arange(cols) // (cols // groups)).all()):
            g_idx = None  # groups in column order (GPTQ without desc_act still writes g_idx)
    return Unpacked(prefix, codes, zeros, scales, g_idx)


def choose_format(u: Unpacked, bits: int) -> tuple[str | None, str]:
    """The block format that holds `u` exactly, or None and why it stays float."""
    if u.group_size % 32:
        return None, f"group size {u.group_size} is not a multiple of the formats' 32-value blocks"
    if u.scales.dtype != torch.float16 and not bool((u.scales.to(torch.float16).to(u.scales.dtype) == u.scales).all()):
        return None, f"its {u.scales.dtype} scales do not all fit in fp16"
    zmin, zmax = int(u.zeros.min()), int(u.zeros.max())
    if bits == 4:
        return ("Q4_0", "") if zmin == zmax == 8 else ("Q5_0", "")
    if zmin == zmax == 128:
        return "Q8_0", ""
    return None, "8-bit codes with zeros other than 128 span more than Q8_0's int8 range"


def repack(u: Unpacked, fmt: str) -> QuantTensor:
    """`u` as `fmt` blocks, its columns sorted by group (the permutation rides along)."""
    codes, perm = u.codes, None
    if u.g_idx is not None:
        perm = torch.argsort(u.g_idx, stable=True)
        codes = codes[:, perm]
    out, cols = codes.shape
    gs = u.group_size
    block_group = torch.arange(cols // 32) * 32 // gs
    v = codes.view(out, cols // 32, 32).to(torch.int16) - u.zeros[:, block_group].unsqueeze(-1)
    d = u.scales[:, block_group].to(torch.float16).contiguous().view(torch.uint8).view(out, -1, 2)
    if fmt == "Q8_0":
        body = v.to(torch.int8).view(torch.uint8)
    else:
        c = (v + (8 if fmt == "Q4_0" else 16)).to(torch.uint8)
        body = (c[..., :16] & 15) | ((c[..., 16:] & 15) << 4)
        if fmt == "Q5_0":
            bits = ((c >> 4) & 1).to(torch.int64) << torch.arange(32)
            qh = bits.sum(-1).to(torch.int32).unsqueeze(-1).view(torch.uint8)  # little-endian uint32
            body = torch.cat([qh, body], dim=-1)
    data = torch.cat([d, body], dim=-1).reshape(out, -1).contiguous()
    return QuantTensor(fmt, data, (out, cols), col_perm=perm)


@dataclass
class CheckpointPlan:
    """What the loader does with each quantized weight of a checkpoint."""

    scheme: Scheme
    prefixes: dict[str, set[str]]  # prefix -> the suffixes present
    formats: dict[str, str | None]  # prefix -> block format, or None: loaded as float

    def weight_names(self, quantized: bool) -> set[str]:
        """The `.weight` names that arrive as QuantTensors."""
        return {f"{p}.weight" for p, f in self.formats.items() if quantized and f is not None}

    def summary(self) -> str:
        counts = Counter(f or "float" for f in self.formats.values())
        return f"{self.scheme.describe()} -> " + ", ".join(f"{f} x{n}" for f, n in counts.most_common())


def plan(scheme: Scheme, keys: list[str], read, shape_of) -> CheckpointPlan:
    """Find the quantized weights among `keys` and choose each one's format. `read(key)` loads a
    tensor, `shape_of(key)` tells its shape: only the small ones (zeros, scales, g_idx) are read
    here, the codes are not."""
    prefixes: dict[str, set[str]] = {}
    keyset = set(keys)
    for key in keys:
        if key.endswith("." + scheme.marker):
            prefix = key[: -len(scheme.marker) - 1]
            prefixes[prefix] = {s for s in scheme.parts if f"{prefix}.{s}" in keyset}
    if not prefixes:
        raise QuantFormatError(
            f"the checkpoint's quantization_config names {scheme.method}, but no tensor ends in .{scheme.marker}"
        )
    formats: dict[str, str | None] = {}
    for prefix, present in prefixes.items():
        small = {s: read(f"{prefix}.{s}") for s in present if s != scheme.marker}
        codes = torch.empty(shape_of(f"{prefix}.{scheme.marker}"), dtype=torch.int32, device="meta")
        u = unpack(scheme, prefix, {**small, scheme.marker: codes})
        fmt, why = choose_format(u, scheme.bits)
        if fmt is None:
            logger.info("%s: kept as a float weight: %s", prefix, why)
        formats[prefix] = fmt
    return CheckpointPlan(scheme, prefixes, formats)


def convert_stream(
    weights: Iterator[tuple[str, torch.Tensor]], cp: CheckpointPlan, quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """The checkpoint's tensors with each quantized weight's parts gathered into one `.weight`:
    a QuantTensor (`quantized` and a format fits) or its float32 values."""
    owner: dict[str, tuple[str, str]] = {}
    for prefix, present in cp.prefixes.items():
        for s in present:
            owner[f"{prefix}.{s}"] = (prefix, s)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        hit = owner.get(name)
        if hit is None:
            yield name, t
            continue
        prefix, suffix = hit
        parts = pending.setdefault(prefix, {})
        parts[suffix] = t
        if len(parts) < len(cp.prefixes[prefix]):
            continue
        del pending[prefix]
        u = unpack(cp.scheme, prefix, parts)
        fmt = cp.formats[prefix]
        yield f"{prefix}.weight", repack(u, fmt) if quantized and fmt is not None else u.dequantize()
