"""The quantized-weight kernels against gguf-py's reference dequantization followed by a float
matmul, for every format, on every instruction-set path this CPU runs (the scalar reference
always among them), with 1 to 64 rows, odd shapes, and extreme, zero and tiny scales."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.native import cpu_kernels
from pagedllm.quant import kernels as qk
from pagedllm.quant.formats import FORMATS, PACKABLE, PACKED_ID, QuantTensor

Q = gguf.GGMLQuantizationType
ops = cpu_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="native CPU kernels not built here")

# Byte offsets of each format's fp16 scale fields inside a block.
SCALE_OFFSETS = {
    "Q4_0": [0],
    "Q5_0": [0],
    "Q8_0": [0],
    "Q4_1": [0, 2],
    "Q5_1": [0, 2],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q6_K": [208],
}
ISAS = qk.available_isas() if ops is not None else []


def random_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator, scales: str = "normal") -> np.ndarray:
    """Random block bytes with finite fp16 scales of the kind asked for."""
    _, vals, nbytes = FORMATS[fmt]
    raw = rng.integers(0, 256, size=(rows, cols // vals, nbytes), dtype=np.uint8)
    n = rows * (cols // vals)
    for off in SCALE_OFFSETS[fmt]:
        if scales == "normal":
            h = rng.standard_normal(n) * 0.02
        elif scales == "extreme":  # the largest fp16 values, both signs
            h = rng.choice([65504.0, -65504.0, 30000.0], size=n)
        elif scales == "tiny":  # fp16 subnormals
            h = rng.choice([6e-8, -6e-8, 1e-6], size=n)
        else:  # "zero": every other block scaled by zero
            h = np.where(np.arange(n) % 2 == 0, 0.0, rng.standard_normal(n) * 0.02)
        raw[:, :, off : off + 2] = h.astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def quantize_acts(x: np.ndarray) -> np.ndarray:
    """The kernels' activation format: int8 with one float32 scale per 32 values, as floats."""
    xb = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(xb).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.rint(xb * inv) * d).astype(np.float32).reshape(x.shape)


def reference(raw: np.ndarray, fmt: str, rows: int, cols: int, x: np.ndarray, levels: int) -> np.ndarray:
    """gguf's dequantization and a float64 matmul; `levels` 0 multiplies x as it is, 1 its int8
    rounding, 2 that rounding plus the rounding of what it missed (two-level activations)."""
    w = gguf.quants.dequantize(raw, Q[fmt]).reshape(rows, cols).astype(np.float64)
    if levels:
        q1 = quantize_acts(x)
        xq = q1.astype(np.float64)
        if levels == 2:
            xq = xq + quantize_acts((x - q1).astype(np.float32))
        x = xq
    return x.astype(np.float64) @ w.T


def levels_of(m: int) -> int:
    """The activation levels qk.matmul's integer path uses for m rows."""
    mode = qk.activation_mode()
    return 2 if mode == "int8x2" or (mode == "auto" and m <= qk.X2_ROWS) else 1


def assert_close(got: np.ndarray, ref: np.ndarray, rel: float, what: str) -> None:
    scale = max(np.abs(ref).max(), 1e-30)
    err = np.abs(got.astype(np.float64) - ref).max() / scale
    assert err <= rel, f"{what}: max error {err:.2e} of the output's range (allowed {rel:.0e})"


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("isa", ISAS)
def test_integer_kernel_matches_reference(fmt, isa):
    rng = np.random.default_rng(FORMATS[fmt][0])
    vals = FORMATS[fmt][1]
    for rows, nblk, m, scales in [
        (1, 1, 1, "normal"),
        (37, 3, 1, "normal"),
        (5, 2, 2, "zero"),
        (16, 1, 7, "extreme"),
        (3, 2, 3, "tiny"),
        (19, 2, 64, "normal"),
    ]:
        cols = vals * nblk if vals == 256 else 32 * (nblk * 3 + 1)  # odd numbers of legacy blocks
        raw = random_blocks(fmt, rows, cols, rng, scales)
        x = rng.standard_normal((m, cols)).astype(np.float32)
        x[0, :32] = 0.0  # an all-zero activation block
        y = ops.quant_matmul(
            torch.from_numpy(x), [torch.from_numpy(raw)], [FORMATS[fmt][0]], cols, qk.ISA_IDS[isa]
        ).numpy()
        assert y.shape == (m, rows)
        assert np.isfinite(y).all()
        assert_close(y, reference(raw, fmt, rows, cols, x, 1), 2e-5, f"{fmt} {isa} {rows}x{cols} m={m} {scales}")


@pytest.mark.parametrize("isa", ISAS)
def test_mixed_format_parts_in_one_call(isa):
    """A fused projection whose parts differ in format (q/k in Q4_K, v in Q6_K) in one call."""
    rng = np.random.default_rng(7)
    cols = 512
    parts = [("Q4_K", 24), ("Q4_K", 8), ("Q6_K", 8), ("Q8_0", 3)]
    raws = [random_blocks(f, r, cols, rng) for f, r in parts]
    x = rng.standard_normal((3, cols)).astype(np.float32)
    y = ops.quant_matmul(
        torch.from_numpy(x),
        [torch.from_numpy(r) for r in raws],
        [FORMATS[f][0] for f, _ in parts],
        cols,
        qk.ISA_IDS[isa],
    ).numpy()
    ref = np.concatenate([reference(r, f, n, cols, x, 1) for r, (f, n) in zip(raws, parts)], axis=1)
    assert_close(y, ref, 2e-5, f"mixed {isa}")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantize_is_exact(fmt):
    rng = np.random.default_rng(1)
    cols = FORMATS[fmt][1] * 2
    raw = random_blocks(fmt, 9, cols, rng)
    ref = gguf.quants.dequantize(raw, Q[fmt]).reshape(9, cols)
    for isa in ISAS:
        got = ops.quant_dequant(
            torch.from_numpy(raw), FORMATS[fmt][0], cols, None, 0, -1, torch.float32, qk.ISA_IDS[isa]
        ).numpy()
        np.testing.assert_array_equal(got, ref, err_msg=f"{fmt} {isa}")
    # A slice of rows, and an embedding-style lookup with repeats, in bf16.
    qt = QuantTensor(fmt, torch.from_numpy(raw), (9, cols))
    part = ops.quant_dequant(qt.data, qt.type_id, cols, None, 2, 4, torch.float32, 0).numpy()
    np.testing.assert_array_equal(part, ref[2:6])
    ids = torch.tensor([8, 0, 3, 3])
    rows = qk.embedding(qt, ids, torch.bfloat16)
    assert torch.equal(rows, torch.from_numpy(ref[ids.numpy()]).to(torch.bfloat16))


def test_many_rows_take_the_gemm_route():
    """Past INT_ROWS a weight in the file's layout is dequantized by tiles and multiplied in
    float: no activation quantization, so it matches the float reference closely."""
    rng = np.random.default_rng(3)
    rows, cols = qk.TILE_ROWS + 5, 256  # more than one tile
    raw = random_blocks("Q4_K", rows, cols, rng)
    qt = QuantTensor("Q4_K", torch.from_numpy(raw), (rows, cols))
    x = rng.standard_normal((qk.int_rows() + 1, cols)).astype(np.float32)
    y = qk.matmul(torch.from_numpy(x), [qt]).numpy()
    assert_close(y, reference(raw, "Q4_K", rows, cols, x, 0), 1e-5, "gemm route")


@pytest.mark.parametrize("m", [qk.int_rows() + 5, 255, 257, 700])
def test_bf16_gemm_route_runs_whole_buckets_of_rows(m, monkeypatch):
    """A bfloat16 product past INT_ROWS runs oneDNN on rows padded to a bucket (qk.gemm_rows),
    so a server meets few new kernel shapes: the m rows that come back are the product of the
    m rows given, as close to the float reference as bfloat16 allows, and the zero rows are not
    returned."""
    rng = np.random.default_rng(m)
    rows, cols = 96, 256
    raw = random_blocks("Q4_K", rows, cols, rng)
    qt = QuantTensor("Q4_K", torch.from_numpy(raw), (rows, cols)).pack()
    x = torch.from_numpy(rng.standard_normal((m, cols)).astype(np.float32)).bfloat16()
    seen = []
    real_mm = torch.mm
    monkeypatch.setattr(qk.torch, "mm", lambda a, b, **kw: seen.append(a.shape[0]) or real_mm(a, b, **kw))
    y = qk.matmul(x, [qt], out_dtype=torch.float32)
    assert y.shape == (m, rows) and set(seen) == {qk.gemm_rows(m)} and qk.gemm_rows(m) % 16 == 0
    ref = reference(raw, "Q4_K", rows, cols, x.float().numpy(), 0)
    assert_close(y.numpy(), ref, 2e-2, "bf16 gemm route")
    assert len({qk.gemm_rows(n) for n in range(17, 4097)}) < 100  # (against 4080 counts)


@pytest.mark.parametrize("packed", [False, True])
def test_gemm_route_tiles_share_one_scratch_buffer(monkeypatch, packed):
    """Tiles bounded by TILE_VALUES (several per part, a last one short), packed tiles with their
    padded rows, two parts in one call: each tile is written into the same per-thread buffer, and
    the product still matches the float reference."""
    monkeypatch.setattr(qk, "TILE_VALUES", 48 * 512)  # 48 rows of 512 values a tile
    rng = np.random.default_rng(5)
    cols, sizes = 512, (112, 80)
    raws = [random_blocks("Q4_K", n, cols, rng) for n in sizes]
    parts = [QuantTensor("Q4_K", torch.from_numpy(r), (n, cols)) for r, n in zip(raws, sizes)]
    if packed:
        parts = [p.pack() for p in parts]
    assert qk.tile_rows(cols) == 48
    x = rng.standard_normal((qk.int_rows() + 3, cols)).astype(np.float32)
    y = qk.matmul(torch.from_numpy(x), parts).numpy()
    ref = np.concatenate([reference(r, "Q4_K", n, cols, x, 0) for r, n in zip(raws, sizes)], axis=1)
    assert_close(y, ref, 1e-5, "tiled gemm route")
    buf = qk._tile_scratch(torch.float32, 1)
    assert buf.numel() >= cols * (48 + qk.TILE_PAD)
    y2 = qk.matmul(torch.from_numpy(x), parts)
    assert qk._tile_scratch(torch.float32, 1).data_ptr() == buf.data_ptr()  # reused, not reallocated
    assert y2.data_ptr() != buf.data_ptr()
    np.testing.assert_array_equal(y2.numpy(), y)
    with pytest.raises(RuntimeError, match="scratch holds 10 values"):
        w = parts[0]
        if packed:
            ops.quant_dequant_packed(
                w.data, w.type_id - PACKED_ID, cols, None, 0, 16, torch.float32, True, torch.empty(10)
            )
        else:
            ops.quant_dequant(w.data, w.type_id, cols, None, 0, 16, torch.float32, 0, torch.empty(10))


def test_bad_shapes_and_scales_are_refused():
    rng = np.random.default_rng(4)
    raw = random_blocks("Q4_K", 4, 256, rng)
    with pytest.raises(RuntimeError, match="not a multiple"):
        ops.quant_matmul(torch.zeros(1, 100), [torch.from_numpy(raw)], [12], 100, 0)
    with pytest.raises(RuntimeError, match="bytes"):
        ops.quant_matmul(torch.zeros(1, 512), [torch.from_numpy(raw)], [12], 512, 0)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        ops.quant_matmul(torch.zeros(1, 256), [torch.from_numpy(raw)], [20], 256, 0)
    qt = QuantTensor("Q4_K", torch.from_numpy(raw.copy()), (4, 256))
    assert qk.bad_scale_blocks(qt) == 0
    qt.data[2, 2:4] = torch.from_numpy(np.array([np.inf], dtype=np.float16).view(np.uint8))  # dmin = inf
    qt.data[3, 0:2] = torch.from_numpy(np.array([np.nan], dtype=np.float16).view(np.uint8))  # d = NaN
    assert qk.bad_scale_blocks(qt) == 2


def test_paged_decode_refuses_a_corrupt_block_table():
    """A bookkeeping bug (a block id outside the pool, a length past the table) raises instead of
    reading stray memory."""
    q = torch.randn(2, 4, 64)
    k = torch.randn(8, 16, 2, 64)
    v = torch.randn(8, 16, 2, 64)
    tables = torch.tensor([[0, 1], [2, 3]])
    lens = torch.tensor([20, 17])
    ops.paged_decode(q, k, v, tables, lens, 0.125, 0)  # sane: runs
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.paged_decode(q, k, v, torch.tensor([[0, 1], [2, 99]]), lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.paged_decode(q, k, v, torch.tensor([[0, -1], [2, 3]]), lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="context length"):
        ops.paged_decode(q, k, v, tables, torch.tensor([20, 40]), 0.125, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_equals_the_unfused_ops(dtype):
    """quant_linear (RMSNorm, projection, bias, silu(gate) * up, residual in one call) against the
    same steps as separate ops on the integer kernel."""
    rng = np.random.default_rng(11)
    k, n = 256, 64
    raw = torch.from_numpy(random_blocks("Q4_K", 2 * n, k, rng))
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, k, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    bias = torch.randn(2 * n, generator=g).to(dtype)
    res = torch.randn(3, n, generator=g).to(dtype)
    # The native RMSNorm sums in the fused call's order: F.rms_norm's order moved a value across
    # an int8 rounding step now and then (the product then differs by a whole step).
    xn = ops.rms_norm(x, w, 1e-5)
    y = ops.quant_matmul(xn, [raw], [12], k, 0).to(dtype) + bias
    gate, up = y.chunk(2, dim=-1)
    want = res + torch.nn.functional.silu(gate) * up
    got = ops.quant_linear(x, [raw], [12], k, w, 1e-5, bias, res, 1, 0)
    assert got.dtype == dtype and got.shape == (3, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: a rounding step may land either side
    assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_a_row_gives_the_same_bits_whatever_the_batch(fmt):
    """Batch invariance: one activation row's output does not depend on how many rows share the
    call (1-4 rows take the register path, more the unpacked-row tiles)."""
    rng = np.random.default_rng(5)
    cols = 512
    raw = torch.from_numpy(random_blocks(fmt, 45, cols, rng))
    x = torch.randn(30, cols)
    full = ops.quant_matmul(x, [raw], [FORMATS[fmt][0]], cols, 0)
    for m in (1, 2, 3, 4, 7):
        part = ops.quant_matmul(x[:m], [raw], [FORMATS[fmt][0]], cols, 0)
        assert torch.equal(part, full[:m]), (fmt, m)


# -- the packed layout (16 rows interleaved per group; native/csrc/quant_packed.cpp) ------------
PACKABLE_FORMATS = list(PACKABLE)


def packed(raw: np.ndarray, fmt: str, rows: int, cols: int) -> QuantTensor:
    return QuantTensor(fmt, torch.from_numpy(raw), (rows, cols)).pack()


@pytest.mark.parametrize("fmt", PACKABLE_FORMATS)
@pytest.mark.parametrize("isa", ISAS)
def test_packed_kernel_matches_reference(fmt, isa):
    rng = np.random.default_rng(20 + FORMATS[fmt][0])
    vals = FORMATS[fmt][1]
    for rows, nblk, m, scales in [
        (16, 1, 1, "normal"),
        (48, 3, 1, "normal"),
        (32, 2, 2, "zero"),
        (16, 1, 9, "extreme"),
        (32, 2, 3, "tiny"),
        (64, 2, 64, "normal"),
        (16, 1, 17, "normal"),
    ]:
        cols = vals * nblk if vals == 256 else 32 * (nblk * 3 + 1)
        raw = random_blocks(fmt, rows, cols, rng, scales)
        qt = packed(raw, fmt, rows, cols)
        x = rng.standard_normal((m, cols)).astype(np.float32)
        x[0, :32] = 0.0
        y = ops.quant_matmul(torch.from_numpy(x), [qt.data], [qt.type_id], cols, qk.ISA_IDS[isa]).numpy()
        assert y.shape == (m, rows) and np.isfinite(y).all()
        assert_close(y, reference(raw, fmt, rows, cols, x, 1), 2e-5, f"packed {fmt} {isa} {rows}x{cols} m={m} {scales}")


@pytest.mark.parametrize("fmt", PACKABLE_FORMATS)
def test_packed_dequantize_is_exact(fmt):
    """Packing is lossless: rows, embedding lookups and the prefill's transposed tiles give
    gguf's dequantized values bit for bit."""
    rng = np.random.default_rng(30)
    rows, cols = 48, FORMATS[fmt][1] * 2
    raw = random_blocks(fmt, rows, cols, rng)
    ref = gguf.quants.dequantize(raw, Q[fmt]).reshape(rows, cols)
    qt = packed(raw, fmt, rows, cols)
    base = qt.type_id - PACKED_ID
    got = ops.quant_dequant_packed(qt.data, base, cols, None, 0, -1, torch.float32, False).numpy()
    np.testing.assert_array_equal(got, ref)
    tile = ops.quant_dequant_packed(qt.data, base, cols, None, 16, 32, torch.float32, True).numpy()
    np.testing.assert_array_equal(tile, ref[16:48].T)
    ids = torch.tensor([47, 0, 17, 17])
    assert torch.equal(qk.embedding(qt, ids, torch.bfloat16), torch.from_numpy(ref[ids.numpy()]).to(torch.bfloat16))


def test_packed_and_file_layout_parts_mix_and_take_the_gemm_route():
    """A fused projection of packed parts (Q4_K, Q5_0) and a file-layout part (Q3_K), through
    the integer kernel and, past INT_ROWS, the dequantize + GEMM route."""
    rng = np.random.default_rng(31)
    cols = 512
    specs = [("Q4_K", 32), ("Q5_0", 16), ("Q3_K", 16)]
    raws = [random_blocks(f, r, cols, rng) for f, r in specs]
    parts = [
        packed(r, f, n, cols) if f in PACKABLE else QuantTensor(f, torch.from_numpy(r), (n, cols))
        for r, (f, n) in zip(raws, specs)
    ]
    for m in (3, qk.int_rows() + 1):
        x = rng.standard_normal((m, cols)).astype(np.float32)
        y = qk.matmul(torch.from_numpy(x), parts).numpy()
        quantized = m <= qk.int_rows()
        levels = levels_of(m) if quantized else 0
        ref = np.concatenate([reference(r, f, n, cols, x, levels) for r, (f, n) in zip(raws, specs)], axis=1)
        assert_close(y, ref, 2e-5 if quantized else 1e-5, f"mixed m={m}")


@pytest.mark.parametrize("role", [None, "qkv_proj"])
def test_wide_steps_of_packed_weights_take_the_integer_kernel_in_chunks(monkeypatch, role, tune):
    """Past INT_ROWS, with quant_wide=int, packed parts run the integer kernel in chunks
    of WIDE_CHUNK rows: one int8 level (two at q|k|v), close to gguf's float reference, and
    every row the same bits as in one kernel call over them all; the folded linear (norm,
    silu(gate) * up, residual) likewise. The LM head, parts in the file's layout, and every
    part by default keep the GEMM route."""
    tune(quant_wide="auto")
    rng = np.random.default_rng(41)
    cols, sizes, m = 512, (64, 32), 2 * qk.WIDE_CHUNK + 37
    raws = [random_blocks("Q4_K", n, cols, rng) for n in sizes]
    parts = [packed(r, "Q4_K", n, cols) for r, n in zip(raws, sizes)]
    assert not qk.integer_route(m, parts) and qk.integer_route(qk.int_rows(), parts)
    tune(quant_wide="int")
    assert m > qk.int_rows() and qk.integer_route(m, parts, role) and not qk.integer_route(m, parts, "lm_head")
    assert not qk.integer_route(m, [QuantTensor("Q4_K", torch.from_numpy(raws[0]), (64, cols))])
    x = torch.from_numpy(rng.standard_normal((m, cols)).astype(np.float32))
    y = qk.matmul(x, parts, role=role)
    levels = 2 if role in qk.X2_WIDE else 1
    ref = np.concatenate([reference(r, "Q4_K", n, cols, x.numpy(), levels) for r, n in zip(raws, sizes)], axis=1)
    assert_close(y.numpy(), ref, 2e-5, f"wide integer route ({levels} levels)")
    isa_id = qk._isa_id(None, m, role)
    whole = ops.quant_matmul(x, [p.data for p in parts], [p.type_id for p in parts], cols, isa_id)
    assert torch.equal(y, whole)
    # The folded call: RMSNorm before, silu(gate) * up, a residual after, chunk by chunk.
    norm = torch.nn.RMSNorm(cols, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    res = torch.randn(m, sum(sizes) // 2)
    got = qk.linear(x, parts, norm, None, res, True, role)
    want = ops.quant_linear(
        x, [p.data for p in parts], [p.type_id for p in parts], cols, norm.weight, 1e-6, None, res, 1, isa_id
    )
    assert got.shape == (m, sum(sizes) // 2) and torch.equal(got, want)
    tune(quant_wide="gemm")
    assert not qk.integer_route(m, parts, role)
    with pytest.raises(ValueError, match="quant_wide='fast' is not one of auto, gemm, int"):
        tune(quant_wide="fast")


def test_wide_steps_of_wide_models_take_the_integer_kernel_by_default_without_amx(monkeypatch, tune):
    """ "auto" (the default) sends steps past INT_ROWS through the integer kernel in models
    INT_WIDE_WIDTH or more wide, where the kernel is AVX-512 VNNI or AVX2 and there is no AMX;
    narrower models, the head, the scalar path and AMX machines keep the GEMM route."""
    tune(quant_wide="auto")
    tune(quant_isa=None)
    tune(amx="0")
    rng = np.random.default_rng(43)
    wide, narrow = qk.INT_WIDE_WIDTH, qk.INT_WIDE_WIDTH - 256
    m = qk.int_rows() + 1
    parts = [packed(random_blocks("Q4_K", 16, wide, rng), "Q4_K", 16, wide) for _ in range(wide // 16)]
    few = [packed(random_blocks("Q4_K", 16, wide, rng), "Q4_K", 16, wide) for _ in range(narrow // 16)]
    simd = qk.kernel_path()[0] in ("avx512-vnni", "avxvnni", "avx2")
    assert qk.integer_route(m, parts, "o_proj") is simd
    assert not qk.integer_route(m, parts, "lm_head") and not qk.integer_route(m, few, "o_proj")
    for forced, wide_int in (("avx2", True), ("scalar", False)):  # (the path is read once a process)
        if forced not in qk.available_isas():
            continue
        tune(quant_isa=forced)
        qk.kernel_path.cache_clear()
        try:
            assert qk.integer_route(m, parts, "o_proj") is wide_int
        finally:
            tune(quant_isa=None)
            qk.kernel_path.cache_clear()
    if qk.cpu_kernels() is not None and hasattr(qk.cpu_kernels(), "quant_amx_rows"):
        tune(amx=True)
        assert qk.integer_route(m, parts, "o_proj") is (simd and qk.amx_rows() == 0)


def test_proposals_take_the_integer_kernel_past_int_rows_at_any_width(monkeypatch, tune):
    """Inside proposals_only (a draft model's forwards) "auto" takes the integer kernel past
    INT_ROWS in narrow models too, where it does for wide ones (AVX-512 VNNI or AVX2, no AMX), and
    rounds activations in one level; the head keeps the GEMM, forced routes and modes stay
    forced, and the flag ends with the block."""
    tune(quant_wide="auto", quant_isa=None, quant_act="auto", quant_x2_wide=None, amx=False)
    rng = np.random.default_rng(44)
    narrow = qk.INT_WIDE_WIDTH // 2
    m = qk.int_rows() + 8
    few = [packed(random_blocks("Q4_K", 16, narrow * 2, rng), "Q4_K", 16, narrow * 2) for _ in range(narrow // 16)]
    simd = qk.kernel_path()[0] in ("avx512-vnni", "avxvnni", "avx2")
    assert not qk.integer_route(m, few, "o_proj")
    with qk.proposals_only():
        assert qk.integer_route(m, few, "o_proj") is simd
        assert not qk.integer_route(m, few, "lm_head")
        # and one level of activation rounding at every width (a draft's proposals are verified)
        assert not any(qk._isa_id(None, r, "qkv_proj", narrow) & qk.ACT_X2 for r in (1, m))
        assert not qk._stack_isa_id(1, narrow) & (qk.ACT_X2 | qk.ACT_X2_PROJ)
        tune(quant_act="int8x2")  # a forced mode stays forced
        assert qk._isa_id(None, 1, None, narrow) & qk.ACT_X2
        tune(quant_act="auto")
        tune(quant_wide="gemm")
        assert not qk.integer_route(m, few, "o_proj")
        tune(quant_wide="auto")
    assert not qk.integer_route(m, few, "o_proj")
    assert qk._isa_id(None, 1, None, narrow) & qk.ACT_X2  # outside: narrow steps two-level


def test_amx_turns_off_by_its_knob(monkeypatch, tune):
    tune(amx="0")
    assert qk.amx_rows() == 0


@pytest.mark.skipif(ops is None or qk.amx_rows() == 0, reason="no AMX-BF16 on this CPU")
@pytest.mark.parametrize("fmt", PACKABLE_FORMATS)
def test_amx_steps_multiply_bf16_weights_with_bf16_activations(fmt, monkeypatch, tune):
    """A bfloat16 step of 16 or more rows over packed weights, on a CPU with AMX: the weights
    dequantized to bfloat16 (what the GEMM route multiplies) times the activations as they are,
    summed in float32. Against gguf's dequantization rounded to bfloat16, in float64; the int8
    kernel (knob amx off) is further off, so the test sees which path ran."""
    tune(amx_rows=16)
    rng = np.random.default_rng(40 + FORMATS[fmt][0])
    vals = FORMATS[fmt][1]
    isa = qk.ISA_IDS["avx512-vnni"]
    for rows, nblk, m in [(16, 1, 16), (48, 2, 17), (32, 3, 33), (64, 1, 40)]:
        cols = vals * nblk if vals == 256 else 32 * (nblk * 3 + 1)
        raw = random_blocks(fmt, rows, cols, rng)
        qt = packed(raw, fmt, rows, cols)
        x = torch.from_numpy(rng.standard_normal((m, cols)).astype(np.float32)).to(torch.bfloat16)
        w = gguf.quants.dequantize(raw, Q[fmt]).reshape(rows, cols).astype(np.float32)
        w16 = torch.from_numpy(w).to(torch.bfloat16).double().numpy()
        ref = x.double().numpy() @ w16.T
        tune(amx=True)
        y = ops.quant_matmul(x, [qt.data], [qt.type_id], cols, isa).numpy()
        assert y.shape == (m, rows)
        assert_close(y, ref, 1e-5, f"AMX {fmt} {rows}x{cols} m={m}")
        tune(amx="0")
        y8 = ops.quant_matmul(x, [qt.data], [qt.type_id], cols, isa).numpy()
        err8 = np.abs(y8 - ref).max() / np.abs(ref).max()
        assert err8 > 1e-4, f"{fmt}: the int8 kernel matched bf16 to {err8:.1e}; did AMX run with the amx knob off?"


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_packed_rows_give_the_same_bits_whatever_the_batch(fmt):
    """A row's output is the same bits in a tile of one row, of a pair or of quads (the VNNI
    kernel runs each differently), and in the first or the second tile of 16."""
    rng = np.random.default_rng(32)
    cols = 512
    qt = packed(random_blocks(fmt, 64, cols, rng), fmt, 64, cols)
    x = torch.randn(30, cols)
    full = ops.quant_matmul(x, [qt.data], [qt.type_id], cols, 0)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 23):
        assert torch.equal(ops.quant_matmul(x[:m], [qt.data], [qt.type_id], cols, 0), full[:m]), m
    assert torch.equal(ops.quant_matmul(x[16:19], [qt.data], [qt.type_id], cols, 0), full[16:19])
    if fmt != "Q4_1":
        return
    full = ops.quant_matmul(x, [qt.data], [qt.type_id], cols, qk.ACT_X2)  # two-level activations
    for m in (1, 3, 4, 5, 9):
        assert torch.equal(ops.quant_matmul(x[:m], [qt.data], [qt.type_id], cols, qk.ACT_X2), full[:m]), m


_AVXVNNI_VS_AVX2 = r"""
import numpy as np, torch
from pagedllm.native import cpu_kernels
from pagedllm.quant import kernels as qk
from pagedllm.quant.formats import FORMATS, PACKABLE, QuantTensor
SCALE_OFFSETS = {offsets}
{random_blocks}
ops = cpu_kernels()
assert "avxvnni" in qk.available_isas(), (ops.native_isa(), qk.available_isas())
rng = np.random.default_rng(68)
checked = 0
for fmt, (tid, vals, _) in FORMATS.items():
    cols = vals * 2 if vals == 256 else 32 * 7
    raw = random_blocks(fmt, 32, cols, rng)
    layouts = [QuantTensor(fmt, torch.from_numpy(raw), (32, cols))]
    if fmt in PACKABLE:
        layouts.append(layouts[0].pack())
    x = torch.randn(40, cols)
    x[0, :32] = 0.0
    for qt in layouts:
        for flags in (0, qk.ACT_X2):
            for m in range(1, 41):
                a, b = (ops.quant_matmul(x[:m], [qt.data], [qt.type_id], cols, qk.ISA_IDS[p] | flags)
                        for p in ("avxvnni", "avx2"))
                assert torch.equal(a, b), (fmt, qt.packed, flags, m, (a - b).abs().max().item())
                checked += 1
print(ops.native_isa(), checked)
"""


def test_avxvnni_path_gives_the_avx2_paths_bits():
    """The avxvnni level (capped there; on a CPU without AVX-VNNI its EVEX twin, csrc/isa.h)
    sums each 4-byte step by one vpdpbusd into int32 where AVX2 sums maddubs' int16 pairs: the
    same integer sums, so the same float operations after them give the same bits, for every
    format, packed and in the file's layout, at 1-40 rows, with one- and two-level activations."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    built = str(ops.native_built_levels()).split(",")
    flags = (
        set(
            next(
                (
                    ln.split(":", 1)[1].split()
                    for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("flags")
                ),
                [],
            )
        )
        if Path("/proc/cpuinfo").exists()
        else set()
    )
    vex = "avxvnni" in built and "avx_vnni" in flags
    twin = "avxvnni (EVEX twin)" in built and {"avx512f", "avx512vl", "avx512_vnni"} <= flags
    if not (vex or twin):
        pytest.skip(f"no build of the avxvnni level this CPU runs (built: {', '.join(built)})")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PAGEDLLM_NATIVE_ISA": "avxvnni", "PYTHONPATH": str(root)}
    import inspect

    script = _AVXVNNI_VS_AVX2.replace("{offsets}", repr(SCALE_OFFSETS)).replace(
        "{random_blocks}", inspect.getsource(random_blocks)
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == str(2 * 40 * (len(FORMATS) + len(PACKABLE))), r.stdout
    assert r.stdout.startswith("avxvnni" if vex else "avxvnni (EVEX twin)"), r.stdout


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("isa", ISAS)
def test_two_level_activations(fmt, isa):
    """ACT_X2 rounds each activation block twice (x ~ d1 q1 + d2 q2): the kernel matches that
    reference, in the packed and the file layout, and lands far closer to the float product than
    one int8 level does (what lifts decode top-1 agreement from ~96% to ~100%)."""
    rng = np.random.default_rng(40 + FORMATS[fmt][0])
    vals = FORMATS[fmt][1]
    rows, m = 32, 5
    cols = vals * 2 if vals == 256 else 32 * 7
    raw = random_blocks(fmt, rows, cols, rng)
    x = rng.standard_normal((m, cols)).astype(np.float32)
    x[1, :32] = 0.0
    layouts = [QuantTensor(fmt, torch.from_numpy(raw), (rows, cols))]
    if fmt in PACKABLE:
        layouts.append(packed(raw, fmt, rows, cols))
    exact = reference(raw, fmt, rows, cols, x, 0)
    scale = np.abs(exact).max()
    one = np.abs(reference(raw, fmt, rows, cols, x, 1) - exact).max() / scale
    for qt in layouts:
        y = ops.quant_matmul(torch.from_numpy(x), [qt.data], [qt.type_id], cols, qk.ISA_IDS[isa] | qk.ACT_X2).numpy()
        what = f"{fmt} {isa} packed={qt.packed}"
        assert_close(y, reference(raw, fmt, rows, cols, x, 2), 2e-5, what)
        two = np.abs(y - exact).max() / scale
        assert two < one / 20, f"{what}: two levels {two:.1e} against one level {one:.1e}"


def test_packing_refuses_what_it_cannot_hold():
    rng = np.random.default_rng(33)
    with pytest.raises(RuntimeError, match="no packed layout"):
        ops.quant_pack(torch.from_numpy(random_blocks("Q3_K", 16, 256, rng)), FORMATS["Q3_K"][0], 256)
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):
        ops.quant_pack(torch.from_numpy(random_blocks("Q4_0", 20, 64, rng)), FORMATS["Q4_0"][0], 64)
    odd = QuantTensor("Q4_0", torch.from_numpy(random_blocks("Q4_0", 20, 64, rng)), (20, 64))
    assert not odd.can_pack and qk.pack([odd])[0] is odd  # kept in the file's layout


@pytest.mark.parametrize("fmt", ["Q8_0", "Q6_K"])
def test_head_rechecks_its_best_logits_on_single_level_steps(fmt, monkeypatch, tune):
    """On steps wider than X2_ROWS the head's activations are one int8 level; each row's
    HEAD_RECHECK best logits are then computed again from the dequantized rows and the unrounded
    hidden state (gguf's dequantization and a float64 product here), and every other logit is the
    kernel's. Two-level steps are left as the kernel gives them."""
    tune(quant_act="auto")
    tune(quant_x2_wide=None)
    rng = np.random.default_rng(77)
    vocab, cols, k = 512, 256, qk.head_recheck()
    assert k >= 2
    raw = random_blocks(fmt, vocab, cols, rng)
    for qt in (QuantTensor(fmt, torch.from_numpy(raw), (vocab, cols)), packed(raw, fmt, vocab, cols)):
        for m in (qk.X2_ROWS + 1, qk.int_rows(), qk.X2_ROWS):
            x = rng.standard_normal((m, cols)).astype(np.float32)
            exact = reference(raw, fmt, vocab, cols, x, 0)
            plain = qk.matmul(torch.from_numpy(x), [qt], out_dtype=torch.float32).numpy()
            got = qk.head_logits(torch.from_numpy(x), [qt]).numpy()
            if m <= qk.X2_ROWS:
                assert np.array_equal(got, plain), m
                continue
            best = np.argsort(-plain, axis=1, kind="stable")[:, :k]
            rechecked = np.zeros_like(got, dtype=bool)
            np.put_along_axis(rechecked, best, True, axis=1)
            assert np.array_equal(got[~rechecked], plain[~rechecked])
            scale = np.abs(exact).max()
            assert np.abs(got[rechecked] - exact[rechecked]).max() <= 1e-5 * scale, (qt.packed, m)
            # (one int8 level is far from that: the recheck is what brought them there)
            assert np.abs(plain[rechecked] - exact[rechecked]).max() > 1e-4 * scale, (qt.packed, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_rms_norm_is_within_an_ulp_of_atens(dtype):
    """The final norm after the all-layer decode (models/llama.py `_final_norm`) against
    torch's F.rms_norm: the sum of squares runs in another order, so float32 values may differ
    in their last 2-3 bits and a few bf16/f16 values round the other way."""
    import torch.nn.functional as F

    if not hasattr(ops, "rms_norm"):
        pytest.skip("native library without rms_norm")
    g = torch.Generator().manual_seed(11)
    for m, k in [(1, 576), (7, 1536), (33, 100), (2, 8)]:
        x = (torch.randn(m, k, generator=g) * 3).to(dtype)
        w = (torch.randn(k, generator=g) * 0.5 + 1).to(dtype)
        got, want = ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (k,), w, 1e-5)
        assert got.dtype == dtype and got.shape == (m, k)
        ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((got.float() - want.float()).abs() <= 4 * ulp).all(), (m, k)
        if dtype != torch.float32:
            assert (got != want).float().mean() < 0.01, (m, k)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.ones(2, 8, dtype=dtype), torch.ones(7, dtype=dtype), 1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_int8_peak_bounds_the_kernel_that_issues_those_products(isa):
    """The int8 dot-product peak (what `bench compare` sets a many-row step against) is a rate
    the integer kernel itself cannot pass: 32 rows through a packed Q4_K projection, timed
    between two peak measurements, multiply-add fewer values a second than the larger of them.
    A miscounted peak (too few products per instruction, or threads left idle) fails this."""
    if isa == "scalar":
        assert qk.int8_peak_gmacs(0.05, isa) is None  # no int8 SIMD: no peak to set a step against
        return
    import time

    n, k, m = 2048, 1536, 32
    w = packed(random_blocks("Q4_K", n, k, np.random.default_rng(0)), "Q4_K", n, k)
    x = torch.randn(m, k)
    ops.quant_matmul(x, [w.data], [w.type_id], k, qk.ISA_IDS[isa])  # (warm)
    before = qk.int8_peak_gmacs(0.15, isa)
    t0, runs = time.perf_counter(), 0
    while (took := time.perf_counter() - t0) < 0.15:
        ops.quant_matmul(x, [w.data], [w.type_id], k, qk.ISA_IDS[isa])
        runs += 1
    after = qk.int8_peak_gmacs(0.15, isa)
    kernel = m * n * k * runs / took / 1e9
    assert 0 < kernel < max(before, after), (kernel, before, after)
