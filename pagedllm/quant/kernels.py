"""The quantized-weight kernels as Python calls, and which paths this machine runs.

Few rows (decode) take the integer path: the activation is quantized to int8 per 32 values
and multiplied with the weight's blocks by integer dot products (AVX-512 VNNI, AVX2, or the
scalar reference). Many rows (prefill, wide batches) are compute bound: the weight is
dequantized a tile of rows at a time into the compute dtype and the GEMM does the rest, or,
in models 1536+ wide on CPUs without AMX (tuning quant_wide), the integer kernel takes them
too, chunk by chunk.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from functools import lru_cache

import torch

from .. import tuning
from ..native import cpu_kernels, disabled_reason
from .formats import PACKED_ID, QuantTensor

# (re-exported: callers reach every quantized-weight call through this module)
from .fused import MoeExperts, lora_stack, moe_stack, qk_norm, qk_norm_available, rms_norm  # noqa: F401
from .isa import ISA_IDS, ISA_NAMES, available_isas, int8_peak_gmacs  # noqa: F401
from .weight_memory import DENSE_SLAB_BYTES, WeightMemory, weight_buffer, weight_memory  # noqa: F401

logger = logging.getLogger(__name__)

# Up to this many rows the integer kernel wins; above it the dequantize + GEMM route does
# (measured on the CPU this was written on; tuning quant_int_rows, default 32, overrides).


def int_rows() -> int:
    """INT_ROWS, above: the most rows a step may have and always take the integer kernel."""
    return tuning.get("quant_int_rows")


# The GEMM route dequantizes a weight a tile of rows at a time: up to TILE_ROWS rows and about
# TILE_VALUES values (8 MB in bf16), so the tile is still in cache when the GEMM reads it. One
# buffer per thread serves every tile: a fresh allocation per tile came back as new pages from
# the kernel, whose faults cost more than the dequantization (a 3B model's 512-token prefill
# spent a third of its time there).
TILE_ROWS = 2048
TILE_VALUES = 4 * 2**20
TILE_PAD = 32  # a transposed tile's rows are this much longer (csrc/quant_packed.cpp)
# The integer kernel past INT_ROWS too (prefill, wide decode batches): packed weights other than
# the LM head (and weights in the file's layout) in chunks of WIDE_CHUNK rows, so that a chunk's
# int8 activations stay in cache while every weight group passes over them; one int8 level, q|k|v
# two, as X2_WIDE says. Chunks, because all 2048 rows in one call no longer keep the
# activations in cache. It rounds activations where the GEMM route is exact, so it is taken
# where that was measured to hold the quality bar (98% top-1, perplexity within 0.5% of the
# dequantized model): models INT_WIDE_WIDTH or more wide (narrower ones fall under it), on CPUs
# whose integer kernel is AVX-512 VNNI or AVX2 and which have no AMX (there the GEMM's bf16
# products run on AMX, faster). On AVX2 the GEMM runs float32 FMAs, 8 products an instruction,
# against maddubs' 32. The decision and its measurements: docs/design/integer-prefill.md.
# tuning quant_wide=gemm | int forces a route.
INT_WIDE_WIDTH = 1536
WIDE_MODES = tuning.choices("quant_wide")  # ("auto", "gemm", "int")
WIDE_CHUNK = 128
_scratch = threading.local()
_route = threading.local()  # proposals_only's flag, per thread


def gemm_rows(m: int) -> int:
    """The rows a reduced-precision GEMM of m rows runs with: m up to 16, else m rounded up to
    a multiple of 16 (to 256) or of 64. oneDNN, which runs torch's bfloat16 and float16
    products on CPU, builds a kernel for every new row count, which costs several times the
    product itself. A server meets a new count with every prefill length, and an MoE layer with
    every expert's group of rows, so a first batch ran several times slower than the same batch
    again. Whole buckets reuse a few kernels; the zero rows add at most a quarter (257 -> 320
    rows). Figures: docs/benchmarks/from-code.md, "oneDNN kernels per row count"."""
    if m <= 16:
        return m
    step = 16 if m <= 256 else 64
    return -(-m // step) * step


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x [m, k] with zero rows appended up to gemm_rows(m) where oneDNN would run the product
    (bfloat16 or float16 on CPU); x itself otherwise."""
    m = x.shape[0]
    if x.dtype not in (torch.bfloat16, torch.float16) or x.device.type != "cpu":
        return x
    return torch.nn.functional.pad(x, (0, 0, 0, gemm_rows(m) - m)) if gemm_rows(m) > m else x


@lru_cache(maxsize=1)
def kernel_path() -> tuple[str | None, str]:
    """(the integer path in use or None, why): None means weights are dequantized at load."""
    off = disabled_reason()
    if off:
        return None, f"native kernels off ({off})"
    isas = available_isas()
    if not isas:
        return None, "the native CPU kernels are not built or do not load here (see the log)"
    forced = tuning.get("quant_isa")
    if forced:
        if forced not in isas:
            raise ValueError(f"tuning quant_isa={forced} is not available here; this CPU runs {isas}")
        return forced, f"forced by tuning quant_isa (available: {', '.join(isas)})"
    if "avx2" not in isas:
        return None, "this CPU has no AVX2; the scalar reference path is too slow to serve"
    best = isas[-1]
    level = str(cpu_kernels().native_isa())
    return best, f"best of {', '.join(isas)} on this CPU at the native level {level}"


# How the integer path rounds activations. "int8": one int8 value per element and a scale per
# 32, as llama.cpp does. "int8x2": the rounding error quantized again as a second row sharing
# the decoded weights (about 14 bits: almost the float model's tokens), which doubles the
# integer dot products. "auto" (the default): int8x2 for steps of up to X2_ROWS rows, which
# stream the weights and pay little for it (batch-1 chat, speculative verification of up to 7
# proposals). Wider steps are compute bound (there int8x2 costs a multiple of a projection), so they
# round in one level except where that moves greedy tokens most for the least work: the
# q|k|v projection stays two-level (X2_WIDE) and the head's best logits are computed again
# (HEAD_RECHECK). A row's rounding therefore depends on its step's width, as the dequantize +
# GEMM route past INT_ROWS already made it. tuning quant_act chooses. The decision and its
# measurements: docs/design/activation-rounding.md.
ACT_MODES = tuning.choices("quant_act")  # ("auto", "int8", "int8x2")
ACT_X2 = 256  # or-ed into the kernels' isa argument (csrc/quant_common.h)
X2_ROWS = 8
# ... and only in models narrower than X2_WIDTH (hidden size; a projection's narrower side):
# wider models round narrow steps as wide ones (one level but X2_WIDE, the head rechecked).
# There the second level does not pay: such a model keeps the 98% top-1 / 0.5% perplexity bar
# with one level, and the second costs its batch-1 step measurably; SmolLM2-135M (hidden 576)
# falls under the bar with one level, so narrow models keep two (docs/design/
# activation-rounding.md, "Wide models: one level on narrow steps too").
X2_WIDTH = 1536
# A projection's role: the attribute its Linear has in a decoder layer or the model (set at
# load, models/llama.py). Bit ACT_X2_PROJ << DECODE_ROLES[role] of quant_decode_layers' isa
# argument makes that projection of every layer two-level.
ROLES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
DECODE_ROLES = {r: j for j, r in enumerate(ROLES[:4])}
ACT_X2_PROJ = 512
# The projections that "auto" keeps two-level on wider steps too, up to INT_ROWS. Chosen by
# measurement (docs/design/activation-rounding.md, "Wide steps: one level, q|k|v two"): q|k|v
# bought the most top-1 agreement for the least time; o, gate|up and down each bought less for
# more. tuning quant_x2_wide (roles, comma-separated) overrides.
X2_WIDE = ("qkv_proj",)


def amx_rows() -> int:
    """Rows from which a bfloat16 step over packed weights takes the AMX tile product
    (quant_packed.cpp; tuning amx_rows, default 16), or 0: no AMX here, or tuning amx=0."""
    ops = cpu_kernels()
    return int(ops.quant_amx_rows()) if ops is not None else 0


def wide_mode() -> str:
    return tuning.get("quant_wide")  # (one of WIDE_MODES: tuning refuses any other)


def integer_route(rows: int, parts: list[QuantTensor], role: str | None = None) -> bool:
    """Whether a step of `rows` rows through `parts` (the projection `role`) takes the integer
    kernel: always up to INT_ROWS; past it, packed parts other than the head where
    tuning quant_wide=int, or where "auto" (the default) finds it measured faster and exact
    enough (wide_int_here)."""
    if rows <= int_rows():
        return True
    wide = wide_steps_int(_width(parts))  # (first: a bad tuning quant_wide is refused on any part)
    return wide and role != "lm_head" and all(p.packed for p in parts)


def wide_steps_int(width: int) -> bool:
    """Whether steps past INT_ROWS of packed projections (the head aside) in a model `width`
    wide take the integer kernel: tuning quant_wide=int, or "auto" where wide_int_here."""
    mode = wide_mode()
    return mode == "int" or (mode == "auto" and wide_int_here(width))


def wide_int_here(width: int) -> bool:
    """Whether "auto" sends steps past INT_ROWS through the integer kernel in a model `width`
    wide on this machine (INT_WIDE_WIDTH, above; any width inside `proposals_only`)."""
    wide_enough = width >= INT_WIDE_WIDTH or getattr(_route, "proposals_only", False)
    return (
        wide_enough and _path_id() in (ISA_IDS["avx512-vnni"], ISA_IDS["avxvnni"], ISA_IDS["avx2"]) and amx_rows() == 0
    )


@contextmanager
def proposals_only():
    """Steps run inside this only propose tokens that another model verifies (a speculative
    draft model's forwards): "auto" takes the integer kernel past INT_ROWS at any width where
    it is faster (AVX-512 VNNI or AVX2, without AMX), as the quality bar that keeps narrow models on the
    GEMM route applies to output, not to proposals; through the GEMM a draft's catch-up of 33
    rows and up dequantizes every weight (docs/benchmarks/from-code.md, "The draft's forwards
    past 32 rows")."""
    before = getattr(_route, "proposals_only", False)
    _route.proposals_only = True
    try:
        yield
    finally:
        _route.proposals_only = before


def activation_mode() -> str:
    return tuning.get("quant_act")  # (one of ACT_MODES: tuning refuses any other)


def wide_x2_roles() -> tuple[str, ...]:
    """The roles "auto" rounds in two levels on steps wider than X2_ROWS."""
    return _wide_roles(tuning.get("quant_x2_wide"))


@lru_cache(maxsize=8)
def _wide_roles(env: str | None) -> tuple[str, ...]:
    if env is None:
        return X2_WIDE
    roles = tuple(r.strip() for r in env.split(",") if r.strip())
    bad = [r for r in roles if r not in ROLES]
    if bad:
        raise ValueError(f"tuning quant_x2_wide names {', '.join(bad)}; the roles are {', '.join(ROLES)}")
    return roles


def _x2(rows: int, role: str | None, width: int = 0) -> bool:
    """Whether "auto" (or the mode chosen) rounds a step of `rows` rows through the projection
    `role` in two levels, in a model `width` wide (its hidden size; 0: unknown, as narrow)."""
    mode, wide = activation_mode(), wide_x2_roles()  # (both checked on every step)
    if mode == "auto" and getattr(_route, "proposals_only", False):
        return False  # a draft's proposals: one level (see proposals_only)
    return mode == "int8x2" or (
        mode == "auto" and ((rows <= X2_ROWS and narrow_steps_x2(width)) or (role is not None and role in wide))
    )


def narrow_steps_x2(width: int) -> bool:
    """Whether "auto" rounds steps of up to X2_ROWS rows in two levels in a model `width` wide."""
    return width < X2_WIDTH


def _isa_id(isa: str | None, rows: int, role: str | None = None, width: int = 0) -> int:
    """The kernels' path argument for a step of `rows` activation rows through the projection
    `role` (one of ROLES, or None) of a model `width` wide: the instruction set's id, with
    ACT_X2 where they are rounded in two levels."""
    isa_id = _path_id() if isa is None else ISA_IDS[isa]
    return isa_id | (ACT_X2 if _x2(rows, role, width) else 0)


def _width(parts: list[QuantTensor]) -> int:
    """A projection's narrower side: the model's hidden size for every projection of a decoder
    layer (down_proj's input is wider, every other one's output) and for the head."""
    return min(parts[0].shape[1], sum(p.shape[0] for p in parts))


def _path_id() -> int:
    path, _ = kernel_path()
    return ISA_IDS[path] if path else 0


def _stack_isa_id(rows: int, width: int) -> int:
    """quant_decode_layers' path argument: `_isa_id` of the step, with the per-projection bits
    of the roles that are two-level where the step as a whole is not."""
    isa = _isa_id(None, rows, None, width)
    if isa & ACT_X2:
        return isa
    for role, j in DECODE_ROLES.items():
        if _x2(rows, role, width):
            isa |= ACT_X2_PROJ << j
    return isa


def matmul(
    x: torch.Tensor,
    parts: list[QuantTensor],
    isa: str | None = None,
    out_dtype: torch.dtype | None = None,
    role: str | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in `out_dtype` (default x's), W the row-wise concatenation of
    `parts`, the projection `role` (ROLES) if known. The integer kernel accumulates in float32,
    so asking for float32 loses nothing."""
    ops = cpu_kernels()
    out_dtype = out_dtype or x.dtype
    if isa is not None or integer_route(x.shape[0], parts, role):
        isa_id = _isa_id(isa, x.shape[0], role, _width(parts))
        y = _chunked(
            x,
            sum(p.shape[0] for p in parts),
            torch.float32,
            lambda rows: ops.quant_matmul(
                x[rows], [p.data for p in parts], [p.type_id for p in parts], parts[0].shape[1], isa_id
            ),
        )
        return y if out_dtype == torch.float32 else y.to(out_dtype)
    # Tile by tile into one output (no list of partial products and no cat: at prefill sizes
    # those doubled the step's peak memory).
    m, x = x.shape[0], pad_rows(x)
    y = torch.empty(x.shape[0], sum(p.shape[0] for p in parts), dtype=x.dtype, device=x.device)
    k, col = parts[0].shape[1], 0
    rows = tile_rows(k)
    scratch = _tile_scratch(x.dtype, k * (rows + TILE_PAD))
    for w in parts:
        for start in range(0, w.shape[0], rows):
            count = min(rows, w.shape[0] - start)
            if w.packed:  # a [K, count] tile: the packed groups' lanes are its rows' runs
                tile = ops.quant_dequant_packed(
                    w.data, w.type_id - PACKED_ID, k, None, start, count, x.dtype, True, scratch
                )
                torch.mm(x, tile, out=y[:, col : col + count])
            else:
                tile = ops.quant_dequant(w.data, w.type_id, k, None, start, count, x.dtype, 0, scratch)
                torch.mm(x, tile.t(), out=y[:, col : col + count])
            col += count
    return y[:m].to(out_dtype)


def moe_experts_available() -> bool:
    """Whether the native `quant_moe_experts` / `quant_moe_block` run here (the kernels load)."""
    return cpu_kernels() is not None


def _moe_x2(rows: int, width: int) -> int:
    """quant_moe_experts' x2 bits for a step of `rows` rows: its experts' gate|up (bit 0) and
    down (bit 1) inputs in two levels where a dense layer's gate_up_proj / down_proj would round
    that step's in two levels. By the step's width, not each expert's few rows: a 32-row step
    whose experts each see a few rows is compute bound as a whole, and two levels there cost
    what a dense layer's wide steps are spared (docs/benchmarks/from-code.md, "Experts' rounding
    by the step's width")."""
    return int(_x2(rows, "gate_up_proj", width)) | int(_x2(rows, "down_proj", width)) << 1


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: MoeExperts) -> torch.Tensor:
    """[T, H] float32: each row's routed experts (ids, weights [T, k]) run and summed by weight, in
    one native call, the experts' inputs rounded as the step's width decides (`_moe_x2`)."""
    return cpu_kernels().quant_moe_experts(
        x,
        ids,
        weights,
        experts.gate_up,
        experts.gate_up_types,
        experts.gate_up_parts,
        experts.down,
        experts.down_types,
        _path_id(),
        _moe_x2(x.shape[0], x.shape[1]),
    )


def moe_block(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    router: torch.Tensor,
    top_k: int,
    renormalize: bool,
    round_weights: bool,
    experts: MoeExperts,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + the routed experts of rms_norm(x) in x's dtype, expert ids [T, k]): a whole MoE block
    (norm, float32 router, softmax, top k, `moe_experts`, residual) in one native call.
    `router`: its float32 [E, H] weight; `round_weights`: the routing weights rounded to x's
    dtype before they scale (Qwen, OLMoE) rather than kept in float32 (Mixtral)."""
    return cpu_kernels().quant_moe_block(
        x,
        norm_weight,
        eps,
        router,
        top_k,
        renormalize,
        round_weights,
        experts.gate_up,
        experts.gate_up_types,
        experts.gate_up_parts,
        experts.down,
        experts.down_types,
        _path_id(),
        _moe_x2(x.shape[0], x.shape[1]),
    )


# Where a step's head runs with single-level (int8) activations, each row's HEAD_RECHECK best
# logits are computed again from the dequantized head rows and the unrounded hidden state:
# which token is greedy's then moves only when int8 rounding moves a logit past more than
# HEAD_RECHECK - 1 others, instead of at every near-tie. It costs one top-k pass over the logits
# (docs/benchmarks/from-code.md, "The head's best logits rechecked"), where rounding the head in two
# levels costs as much again as the head itself. tuning quant_head_recheck (default 4) sets
# HEAD_RECHECK (0: off).


def head_recheck() -> int:
    """HEAD_RECHECK, above: how many of a single-level head's best logits are computed again."""
    return tuning.get("quant_head_recheck")


def head_logits(hidden: torch.Tensor, parts: list[QuantTensor]) -> torch.Tensor:
    """The LM head's [rows, vocab] float32 logits for hidden [rows, K] ("auto" rechecks the best
    of a single-level step; tuning quant_act=int8 is llama.cpp's rounding, unrechecked)."""
    logits = matmul(hidden, parts, out_dtype=torch.float32, role="lm_head")
    rows, recheck = hidden.shape[0], head_recheck()
    if (
        rows > int_rows()
        or activation_mode() != "auto"
        or _x2(rows, "lm_head", _width(parts))
        or len(parts) != 1
        or recheck < 1
    ):
        return logits  # exact already (the GEMM route), two-level, or a rounding chosen by hand
    k = min(recheck, logits.shape[1])
    ops = cpu_kernels()
    _, ids, _ = ops.sample_topk(logits, torch.ones(rows), k, None, False)
    w = embedding(parts[0], ids.view(-1), torch.float32).view(rows, k, -1)
    exact = torch.bmm(w, hidden.float().unsqueeze(2)).squeeze(2)
    return logits.scatter_(1, ids, exact)


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


def _chunked(x: torch.Tensor, n_out: int, dtype: torch.dtype, call) -> torch.Tensor:
    """call(rows) for x's rows: all at once up to WIDE_CHUNK of them, else chunk by chunk into one
    output. A row's result does not depend on its chunk: the kernels compute each row alone, at
    the rounding the caller chose for the whole step."""
    m = x.shape[0]
    if m <= WIDE_CHUNK:
        return call(slice(None))
    y = torch.empty(m, n_out, dtype=dtype, device=x.device)
    for r0 in range(0, m, WIDE_CHUNK):
        rows = slice(r0, r0 + WIDE_CHUNK)
        y[rows] = call(rows)
    return y


def linear(
    x: torch.Tensor,
    parts: list[QuantTensor],
    norm,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    silu_mul: bool,
    role: str | None = None,
) -> torch.Tensor:
    """The integer path with the layer's RMSNorm (`norm`: weight and eps), bias, silu(gate) * up
    and residual folded into one native call; output in x's dtype."""
    ops, k, act = cpu_kernels(), parts[0].shape[1], 1 if silu_mul else 0
    data, types, isa_id = (
        [p.data for p in parts],
        [p.type_id for p in parts],
        _isa_id(None, x.shape[0], role, _width(parts)),
    )
    w, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
    n_out = sum(p.shape[0] for p in parts) // (2 if silu_mul else 1)
    return _chunked(
        x,
        n_out,
        x.dtype,
        lambda rows: ops.quant_linear(
            x[rows], data, types, k, w, eps, bias, None if residual is None else residual[rows], act, isa_id
        ),
    )


def decode_layers_available() -> bool:
    """Whether the native all-layer decode (`decode_layers`) runs here (the kernels load)."""
    return cpu_kernels() is not None


def decode_layers_take_lora() -> bool:
    """Whether the native all-layer decode adds LoRA deltas (it does wherever it runs; a name of
    its own so that a test can send adapter steps layer by layer)."""
    return decode_layers_available()


def decode_layers_take_qk_norms() -> bool:
    """Whether the native all-layer decode applies per-head q/k norms (Qwen3): wherever it runs."""
    return decode_layers_available()


def decode_layers_take_moe() -> bool:
    """Whether the native all-layer decode runs sparse MoE blocks and whole-projection q/k norms
    (OLMoE): wherever it runs."""
    return decode_layers_available()


def decode_layers(
    h: torch.Tensor,
    plan: dict,
    kv,
    rope: tuple[torch.Tensor, torch.Tensor],
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    lora: tuple | None = None,
) -> torch.Tensor:
    """Every decoder layer of a decode-only step in one native call: per layer the fused
    projections of `plan` (the flattened quantized weights, norms and biases), rope, the paged
    cache write and attention over `kv` (an attention.backend.DecodeStack, read here only).
    `lora`: (a `lora_stack` of the step's slots (see lora.layers.LinearLoRA), the step's
    groups' slots in it, their rows or None for all rows), the adapter rows' low-rank products
    added to their projections."""
    cos, sin = rope
    op = cpu_kernels().quant_decode_layers
    return op(
        h,
        plan["weights"],
        plan["types"],
        plan["parts"],
        plan["kdims"],
        plan["norms"],
        plan["eps"],
        plan["biases"],
        kv.k,
        kv.v,
        kv.windows,
        cos,
        sin,
        kv.slot_mapping,
        kv.block_tables,
        kv.context_lens,
        num_heads,
        num_kv_heads,
        scale,
        *(lora or (None, [], [])),
        _stack_isa_id(h.shape[0], h.shape[1]),
        kv.k_scales,
        kv.v_scales,
        plan.get("qk_norms", []),
        *((plan["moe"], _path_id(), _moe_x2(*h.shape), plan["qkv_clip"]) if plan.get("moe") is not None else ()),
    )


def embedding(w: QuantTensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of w as `dtype`: the embedding lookup reads only the rows it needs."""
    if w.packed:
        return cpu_kernels().quant_dequant_packed(w.data, w.type_id - PACKED_ID, w.shape[1], ids, 0, -1, dtype, False)
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
