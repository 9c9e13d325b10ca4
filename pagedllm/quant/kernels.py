"""The quantized-weight kernels as Python calls, and which paths this machine runs.

Few rows (decode) take the integer path: the activation is quantized to int8 per 32 values
and multiplied with the weight's blocks by integer dot products (AVX-512 VNNI, AVX2, or the
scalar reference). Many rows (prefill, wide batches) are compute bound: the weight is
dequantized a tile of rows at a time into the compute dtype and the GEMM does the rest.
"""
from __future__ import annotations

import logging
import os
import threading
from functools import lru_cache

import torch

from ..native import cpu_kernels, disabled_reason
from .formats import PACKED_ID, QuantTensor

logger = logging.getLogger(__name__)

ISA_NAMES = {1: "scalar", 2: "avx2", 3: "avx512-vnni"}
ISA_IDS = {v: k for k, v in ISA_NAMES.items()}
# Up to this many rows the integer kernel wins; above it the dequantize + GEMM route does
# (measured on the CPU this was written on; PAGEDLLM_QUANT_INT_ROWS overrides).
INT_ROWS = int(os.environ.get("PAGEDLLM_QUANT_INT_ROWS", "32"))
# The GEMM route dequantizes a weight a tile of rows at a time: up to TILE_ROWS rows and about
# TILE_VALUES values (8 MB in bf16), so the tile is still in cache when the GEMM reads it. One
# buffer per thread serves every tile: a fresh allocation per tile came back as new pages from
# the kernel, whose faults cost more than the dequantization (a 3B model's 512-token prefill
# spent a third of its time there).
TILE_ROWS = 2048
TILE_VALUES = 4 * 2**20
TILE_PAD = 32  # a transposed tile's rows are this much longer (csrc/quant_packed.cpp)
_scratch = threading.local()


def available_isas() -> list[str]:
    ops = cpu_kernels()
    if ops is None:
        return []
    mask = int(ops.quant_isas())
    return [name for i, name in ISA_NAMES.items() if mask & (1 << (i - 1))]


@lru_cache(maxsize=1)
def kernel_path() -> tuple[str | None, str]:
    """(the integer path in use or None, why): None means weights are dequantized at load."""
    off = disabled_reason()
    if off:
        return None, f"native kernels off ({off})"
    isas = available_isas()
    if not isas:
        return None, "the native CPU kernels are not built or do not load here (see the log)"
    forced = os.environ.get("PAGEDLLM_QUANT_ISA")
    if forced:
        if forced not in isas:
            raise ValueError(f"PAGEDLLM_QUANT_ISA={forced} is not available here; this CPU runs {isas}")
        return forced, f"forced by PAGEDLLM_QUANT_ISA (available: {', '.join(isas)})"
    if "avx2" not in isas:
        return None, "this CPU has no AVX2; the scalar reference path is too slow to serve"
    best = isas[-1]
    return best, f"best of {', '.join(isas)} on this CPU"


# How the integer path rounds activations. "int8": one int8 value per element and a scale per
# 32, as llama.cpp does (95.8% top-1 agreement with float weights on SmolLM2 Q4_1, token by
# token). "int8x2": the rounding error quantized again as a second row sharing the decoded
# weights (about 14 bits: 99.98%), which doubles the integer dot products. "auto" (the
# default): int8x2 for steps of up to X2_ROWS rows, which stream the weights and pay little
# for it (about 5% at one row: batch-1 chat, speculative verification of up to 7 proposals),
# int8 for wider steps, which are compute bound (int8x2 cost 30% at 32 rows). A row's rounding
# therefore depends on its step's width, as the dequantize + GEMM route past INT_ROWS already
# made it. PAGEDLLM_QUANT_ACT chooses.
ACT_MODES = ("auto", "int8", "int8x2")
ACT_X2 = 256  # or-ed into the kernels' isa argument (csrc/quant_common.h)
X2_ROWS = 8


def activation_mode() -> str:
    mode = os.environ.get("PAGEDLLM_QUANT_ACT", "auto")
    if mode not in ACT_MODES:
        raise ValueError(f"PAGEDLLM_QUANT_ACT={mode!r} is not one of {', '.join(ACT_MODES)}")
    return mode


def _isa_id(isa: str | None, rows: int) -> int:
    """The kernels' path argument for a step of `rows` activation rows: the instruction set's
    id, with ACT_X2 where they are rounded in two levels."""
    if isa is None:
        path, _ = kernel_path()
        isa_id = ISA_IDS[path] if path else 0
    else:
        isa_id = ISA_IDS[isa]
    mode = activation_mode()
    x2 = mode == "int8x2" or (mode == "auto" and rows <= X2_ROWS)
    return isa_id | (ACT_X2 if x2 else 0)


def matmul(x: torch.Tensor, parts: list[QuantTensor], isa: str | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in `out_dtype` (default x's), W the row-wise concatenation of
    `parts`. The integer kernel accumulates in float32, so asking for float32 loses nothing."""
    ops = cpu_kernels()
    out_dtype = out_dtype or x.dtype
    if x.shape[0] <= INT_ROWS or isa is not None:
        y = ops.quant_matmul(x, [p.data for p in parts], [p.type_id for p in parts], parts[0].shape[1],
                             _isa_id(isa, x.shape[0]))
        return y if out_dtype == torch.float32 else y.to(out_dtype)
    # Tile by tile into one output (no list of partial products and no cat: at prefill sizes
    # those doubled the step's peak memory).
    y = torch.empty(x.shape[0], sum(p.shape[0] for p in parts), dtype=x.dtype, device=x.device)
    k, col = parts[0].shape[1], 0
    rows = tile_rows(k)
    scratch = _tile_scratch(x.dtype, k * (rows + TILE_PAD))
    for w in parts:
        for start in range(0, w.shape[0], rows):
            count = min(rows, w.shape[0] - start)
            if w.packed:  # a [K, count] tile: the packed groups' lanes are its rows' runs
                tile = ops.quant_dequant_packed(w.data, w.type_id - PACKED_ID, k, None, start, count,
                                                x.dtype, True, scratch)
                torch.mm(x, tile, out=y[:, col:col + count])
            else:
                tile = ops.quant_dequant(w.data, w.type_id, k, None, start, count, x.dtype, 0, scratch)
                torch.mm(x, tile.t(), out=y[:, col:col + count])
            col += count
    return y.to(out_dtype)


def tile_rows(k: int) -> int:
    """Rows per tile of the GEMM route for rows of k values: whole 16-row groups."""
    return max(16, min(TILE_ROWS, TILE_VALUES // k) // 16 * 16)


def _tile_scratch(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """This thread's tile buffer of `dtype`, grown to at least `numel` values."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = bufs[dtype] = torch.empty(numel, dtype=dtype)
    return buf


def linear(x: torch.Tensor, parts: list[QuantTensor], norm, bias: torch.Tensor | None,
           residual: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
    """The integer path with the layer's RMSNorm (`norm`: weight and eps), bias, silu(gate) * up
    and residual folded into one native call; output in x's dtype."""
    return cpu_kernels().quant_linear(
        x, [p.data for p in parts], [p.type_id for p in parts], parts[0].shape[1],
        None if norm is None else norm.weight, 0.0 if norm is None else norm.eps, bias, residual,
        1 if silu_mul else 0, _isa_id(None, x.shape[0]))


def decode_layers_available() -> bool:
    """Whether the native all-layer decode (`decode_layers`) is built here."""
    ops = cpu_kernels()
    return ops is not None and hasattr(ops, "quant_decode_layers")


def decode_layers_take_lora() -> bool:
    """Whether the native all-layer decode adds LoRA deltas (a library built before does not)."""
    ops = cpu_kernels()
    return ops is not None and hasattr(ops, "quant_decode_layers") and _takes_lora(ops.quant_decode_layers)


@lru_cache(maxsize=4)
def _takes_lora(op) -> bool:
    return "LoRAStack" in str(op.default._schema)  # (an older library's LoRA arguments are not read)


def lora_stack(a: list, panels: list, index: list, slots: int):
    """The native LoRAStack `decode_layers` takes: entry j * slots + s is projection j's A,
    B^T's panels and their index for the step's s-th slot (None: that slot leaves it alone)."""
    return torch.classes.pagedllm.LoRAStack(a, panels, index, slots)


def decode_layers(h: torch.Tensor, plan: dict, kv, rope: tuple[torch.Tensor, torch.Tensor], num_heads: int,
                  num_kv_heads: int, scale: float, lora: tuple | None = None) -> torch.Tensor:
    """Every decoder layer of a decode-only step in one native call: per layer the fused
    projections of `plan` (the flattened quantized weights, norms and biases), rope, the paged
    cache write and attention over `kv` (an attention.backend.DecodeStack, read here only).
    `lora`: (a `lora_stack` of the step's slots (see lora.layers.LinearLoRA), the step's
    groups' slots in it, their rows or None for all rows), the adapter rows' low-rank products
    added to their projections."""
    cos, sin = rope
    op = cpu_kernels().quant_decode_layers
    # (a library built before the LoRA arguments takes the base-only call)
    extra = (*(lora or (None, [], [])),) if lora is not None or _takes_lora(op) else ()
    return op(
        h, plan["weights"], plan["types"], plan["parts"], plan["kdims"], plan["norms"], plan["eps"],
        plan["biases"], kv.k, kv.v, kv.windows, cos, sin, kv.slot_mapping, kv.block_tables, kv.context_lens,
        num_heads, num_kv_heads, scale, *extra, _isa_id(None, h.shape[0]))


def embedding(w: QuantTensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of w as `dtype`: the embedding lookup reads only the rows it needs."""
    if w.packed:
        return cpu_kernels().quant_dequant_packed(w.data, w.type_id - PACKED_ID, w.shape[1], ids, 0, -1, dtype,
                                                  False)
    return cpu_kernels().quant_dequant(w.data, w.type_id, w.shape[1], ids, 0, -1, dtype, 0)


def pack(parts: list[QuantTensor]) -> list[QuantTensor]:
    """The parts of one projection in the packed layout where all of them allow it (one kernel
    call must see whole 16-row groups in every part), else as they are."""
    if all(p.can_pack for p in parts):
        return [p.pack() for p in parts]
    return parts


def bad_scale_blocks(w: QuantTensor) -> int:
    """How many blocks carry a NaN or inf scale (checked in the file's layout, before packing)."""
    assert not w.packed
    ops = cpu_kernels()
    if ops is not None:
        return int(ops.quant_bad_scales(w.data, w.type_id, w.shape[1]))
    return int((~torch.isfinite(dequantize_reference(w))).any(dim=1).sum())


def dequantize_reference(w: QuantTensor) -> torch.Tensor:
    """The float32 values `w` stands for, by gguf's reference dequantizer."""
    import gguf
    import numpy as np

    arr = gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType[w.fmt])
    return torch.from_numpy(np.ascontiguousarray(arr.reshape(w.shape)))
