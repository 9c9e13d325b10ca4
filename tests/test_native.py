"""The native CPU decode kernel against the PyTorch path it replaces (gather + SDPA), and
the engine's tokens with it on and off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pagedllm.native import cpu_kernels, disabled_reason


@pytest.fixture(scope="module")
def native():
    if disabled_reason():
        pytest.skip(f"native kernels turned off ({disabled_reason()})")
    mod = cpu_kernels()
    # Not a skip: every install `make` sets up builds them, so a build or load that stops
    # working must fail the suite rather than quietly fall back.
    assert mod is not None, "the native CPU kernels are not built or do not load: see the log line above"
    return mod


def reference(q, kc, vc, tables, lens, scale, window):
    nd, hq, d = q.shape
    hkv = kc.shape[2]
    k, v = kc[tables].flatten(1, 2).float(), vc[tables].flatten(1, 2).float()
    j = torch.arange(k.shape[1])[None]
    m = j < lens[:, None]
    if window:
        m &= j >= lens[:, None] - window
    out = F.scaled_dot_product_attention(
        q.float().view(nd, hkv, hq // hkv, d),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=m[:, None, None],
        scale=scale,
    )
    return out.reshape(nd, hq, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "d,hkv,group,window,index", [(64, 3, 3, 0, torch.int64), (128, 2, 4, 40, torch.int32), (80, 4, 1, 0, torch.int64)]
)
def test_kernel_matches_gather_and_sdpa(native, dtype, d, hkv, group, window, index):
    g = torch.Generator().manual_seed(d + hkv)
    nblocks, bs, n = 64, 16, 7
    kc = torch.randn(nblocks, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nblocks, bs, hkv, d, generator=g).to(dtype)
    lens = torch.tensor([1, 5, 16, 17, 90, 131, 160])
    tables = torch.randint(1, nblocks, (n, 10), generator=g)
    tables[0, 1:] = 0  # padding rows point at the null block and must never be read
    # A query that is a strided view, as the fused qkv projection hands it over.
    q = torch.randn(n, hkv * group, 2 * d, generator=g).to(dtype)[..., :d]
    got = native.paged_decode(q, kc, vc, tables.to(index), lens.to(index), d**-0.5, window)
    want = reference(q, kc, vc, tables, lens, d**-0.5, window)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert got.dtype == dtype and got.shape == (n, hkv * group, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hkv,group,window", [(64, 3, 3, 0), (128, 2, 4, 40), (80, 4, 1, 0)])
def test_kernel_reads_an_int8_cache_with_its_scales(native, dtype, d, hkv, group, window):
    """kv_cache_dtype int8: each stored row is int8 values and one float32 scale per (token,
    head); the kernel scales them as it reads, against SDPA over the dequantized cache."""
    from pagedllm.kv.quant import quantize_int8

    g = torch.Generator().manual_seed(d * hkv)
    nblocks, bs, n = 64, 16, 7
    kq, ks = quantize_int8(torch.randn(nblocks, bs, hkv, d, generator=g) * 3)
    vq, vs = quantize_int8(torch.randn(nblocks, bs, hkv, d, generator=g))
    lens = torch.tensor([1, 5, 16, 17, 90, 131, 160])
    tables = torch.randint(1, nblocks, (n, 10), generator=g)
    q = torch.randn(n, hkv * group, d, generator=g).to(dtype)
    got = native.paged_decode(q, kq, vq, tables, lens, d**-0.5, window, ks, vs)
    want = reference(q, kq.float() * ks[..., None], vq.float() * vs[..., None], tables, lens, d**-0.5, window)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    # The scales are read: other scales give other outputs.
    other = native.paged_decode(q, kq, vq, tables, lens, d**-0.5, window, ks, vs * 2)
    assert not torch.allclose(other.float(), want, atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="needs k_scale and v_scale"):
        native.paged_decode(q, kq, vq, tables, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match=r"float32 \[num_blocks, block_size, Hkv\]"):
        native.paged_decode(q, kq, vq, tables, lens, 1.0, 0, ks[:, :, :1], vs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_an_f8e4m3_cache_with_its_head_scales(native, dtype):
    """kv_cache_dtype f8e4m3: e4m3 values and one float32 scale per (layer, KV head); the kernel
    widens and scales them as it reads, against SDPA over the dequantized cache."""
    from pagedllm.kv.quant import quantize_fp8

    g = torch.Generator().manual_seed(3)
    nblocks, bs, n, hkv, d = 64, 16, 7, 2, 64
    ks, vs = torch.tensor([0.02, 0.005]), torch.tensor([0.01, 0.03])
    kq = quantize_fp8(torch.randn(nblocks, bs, hkv, d, generator=g) * 3, ks)
    vq = quantize_fp8(torch.randn(nblocks, bs, hkv, d, generator=g), vs)
    lens = torch.tensor([1, 5, 16, 17, 90, 131, 160])
    tables = torch.randint(1, nblocks, (n, 10), generator=g)
    q = torch.randn(n, hkv * 3, d, generator=g).to(dtype)
    got = native.paged_decode(q, kq, vq, tables, lens, d**-0.5, 0, ks, vs)
    want = reference(q, kq.float() * ks[:, None], vq.float() * vs[:, None], tables, lens, d**-0.5, 0)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    other = native.paged_decode(q, kq, vq, tables, lens, d**-0.5, 0, ks, vs * 2)
    assert not torch.allclose(other.float(), want, atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match=r"float32 \[Hkv\] \(f8e4m3\)"):
        native.paged_decode(q, kq, vq, tables, lens, 1.0, 0, ks[:1], vs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_writes_the_f8e4m3_cache_as_the_pytorch_path_does(native, dtype):
    """paged_decode_qkv into an f8e4m3 cache: k after rope in the compute dtype, and v, divided
    by their head's scale and rounded to e4m3 with the bits of kv/quant.py's quantize_fp8 (values
    past +-448 saturate), then attention over them as paged_decode reads them."""
    from pagedllm.kv.quant import quantize_fp8
    from pagedllm.models.rope import apply_rope

    g = torch.Generator().manual_seed(6)
    hq, hkv, d, n = 6, 2, 64, 3
    qkv = (torch.randn(n, (hq + 2 * hkv) * d, generator=g) * 4).to(dtype)
    qkv[1, (hq + hkv) * d] = 1e4  # saturates at 448 * scale
    cos, sin = torch.randn(n, 1, d // 2, generator=g).to(dtype), torch.randn(n, 1, d // 2, generator=g).to(dtype)
    slots, tables, lens = (
        torch.tensor([5, 40, 41]),
        torch.tensor([[0, 2, 0], [0, 2, 3], [0, 2, 3]]),
        torch.tensor([6, 41, 42]),
    )
    kc = torch.zeros(4, 16, hkv, d, dtype=torch.float8_e4m3fn)
    vc = torch.zeros(4, 16, hkv, d, dtype=torch.float8_e4m3fn)
    ks, vs = torch.tensor([0.05, 0.02]), torch.tensor([0.01, 0.03])
    out = native.paged_decode_qkv(qkv, cos, sin, kc, vc, slots, tables, lens, hq, hkv, 0.125, 0, ks, vs)
    qk = apply_rope(qkv[:, : (hq + hkv) * d].reshape(n, hq + hkv, d), cos, sin)
    kq = quantize_fp8(qk[:, hq:], ks)
    vq = quantize_fp8(qkv[:, (hq + hkv) * d :].reshape(n, hkv, d), vs)
    bits = lambda t: t.view(torch.uint8).view(-1, hkv, d)  # noqa: E731
    assert torch.equal(bits(kc)[slots], kq.view(torch.uint8)) and torch.equal(bits(vc)[slots], vq.view(torch.uint8))
    assert vc.view(-1, hkv, d)[40, 0, 0].float() == 448
    want = native.paged_decode(qk[:, :hq].contiguous(), kc, vc, tables, lens, 0.125, 0, ks, vs)
    assert torch.equal(out, want.reshape(n, hq * d))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_writes_the_int8_cache_as_the_pytorch_path_does(native, dtype):
    """paged_decode_qkv into an int8 cache: k after rope, and v, quantized per (token, head) with
    the same bits and scales as the PyTorch path's write (rope in the compute dtype, then
    kv/quant.py's quantize_int8), then attention over them as paged_decode reads them."""
    from pagedllm.kv.quant import quantize_int8
    from pagedllm.models.rope import apply_rope

    g = torch.Generator().manual_seed(5)
    hq, hkv, d, n = 6, 2, 64, 3
    qkv = (torch.randn(n, (hq + 2 * hkv) * d, generator=g) * 4).to(dtype)
    qkv[2, (hq + hkv) * d : (hq + hkv + 1) * d] = 0  # an all-zero V head: scale 0, reads back as zeros
    cos, sin = torch.randn(n, 1, d // 2, generator=g).to(dtype), torch.randn(n, 1, d // 2, generator=g).to(dtype)
    slots, tables, lens = (
        torch.tensor([5, 40, 41]),
        torch.tensor([[0, 2, 0], [0, 2, 3], [0, 2, 3]]),
        torch.tensor([6, 41, 42]),
    )
    kc, vc = torch.zeros(4, 16, hkv, d, dtype=torch.int8), torch.zeros(4, 16, hkv, d, dtype=torch.int8)
    ks, vs = torch.zeros(4, 16, hkv), torch.zeros(4, 16, hkv)
    out = native.paged_decode_qkv(qkv, cos, sin, kc, vc, slots, tables, lens, hq, hkv, 0.125, 0, ks, vs)
    qk = apply_rope(qkv[:, : (hq + hkv) * d].reshape(n, hq + hkv, d), cos, sin)
    kq, kscale = quantize_int8(qk[:, hq:])
    vq, vscale = quantize_int8(qkv[:, (hq + hkv) * d :].reshape(n, hkv, d))
    flat = lambda t: t.view(-1, *t.shape[2:])  # noqa: E731
    assert torch.equal(flat(kc)[slots], kq) and torch.equal(flat(ks)[slots], kscale)
    assert torch.equal(flat(vc)[slots], vq) and torch.equal(flat(vs)[slots], vscale)
    assert flat(vs)[41, 0] == 0
    want = native.paged_decode(qk[:, :hq].contiguous(), kc, vc, tables, lens, 0.125, 0, ks, vs)
    assert torch.equal(out, want.reshape(n, hq * d))
    with pytest.raises(RuntimeError, match="needs k_scale and v_scale"):
        native.paged_decode_qkv(qkv, cos, sin, kc, vc, slots, tables, lens, hq, hkv, 0.125, 0)


@pytest.mark.parametrize("cache", [torch.bfloat16, torch.float16])
def test_float32_queries_read_a_half_width_cache(native, cache):
    """kv_cache_dtype bf16 / f16 under float32 compute: the kernel widens each stored key and
    value to float32 as it reads it, which is exactly attention over the widened cache."""
    g = torch.Generator().manual_seed(11)
    kc = torch.randn(32, 16, 2, 64, generator=g).to(cache)
    vc = torch.randn(32, 16, 2, 64, generator=g).to(cache)
    lens = torch.tensor([1, 30, 77, 200])
    tables = torch.randint(1, 32, (4, 13), generator=g)
    q = torch.randn(4, 6, 64, generator=g)
    got = native.paged_decode(q, kc, vc, tables, lens, 0.125, 0)
    assert got.dtype == torch.float32
    want = native.paged_decode(q, kc.float(), vc.float(), tables, lens, 0.125, 0)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(got, reference(q, kc, vc, tables, lens, 0.125, 0), atol=1e-5, rtol=1e-5)
    # The fused path rounds k and v to the cache's dtype as the PyTorch path's write does.
    qkv = torch.randn(2, 10 * 64, generator=g)
    cos, sin = torch.randn(2, 1, 32, generator=g), torch.randn(2, 1, 32, generator=g)
    slots = torch.tensor([5, 40])
    kc2, vc2 = torch.zeros(4, 16, 2, 64, dtype=cache), torch.zeros(4, 16, 2, 64, dtype=cache)
    t2, l2 = torch.tensor([[0, 2, 0], [0, 2, 3]]), torch.tensor([6, 41])
    native.paged_decode_qkv(qkv, cos, sin, kc2, vc2, slots, t2, l2, 6, 2, 0.125, 0)
    kf, vf = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    native.paged_decode_qkv(qkv, cos, sin, kf, vf, slots, t2, l2, 6, 2, 0.125, 0)
    assert torch.equal(kc2, kf.to(cache)) and torch.equal(vc2, vf.to(cache))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_one_sequence_read_its_cache_once_with_the_same_bits(native, dtype):
    """Consecutive positions of one sequence (speculative verification: the last token and its
    proposals) are grouped so their keys and values are read once; each row must come out
    bit for bit as when it is computed alone, and match SDPA. Groups cross a block boundary
    (lengths 30..35 over blocks of 16), sit beside ordinary rows, and stop where the table
    differs."""
    g = torch.Generator().manual_seed(11)
    nblocks, bs, hkv, group, d = 32, 16, 3, 3, 64
    kc = torch.randn(nblocks, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nblocks, bs, hkv, d, generator=g).to(dtype)
    shared = torch.randint(1, nblocks, (6,), generator=g)
    other = torch.randint(1, nblocks, (6,), generator=g)
    tables = torch.stack([shared] * 6 + [other] + [shared] * 2 + [other.flip(0)] * 2)
    lens = torch.tensor([30, 31, 32, 33, 34, 35, 7, 50, 51, 20, 21])
    q = torch.randn(len(lens), hkv * group, d, generator=g).to(dtype)
    together = native.paged_decode(q, kc, vc, tables, lens, d**-0.5, 0)
    for i in range(len(lens)):
        alone = native.paged_decode(q[i : i + 1], kc, vc, tables[i : i + 1], lens[i : i + 1], d**-0.5, 0)
        assert torch.equal(together[i : i + 1], alone), i
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(together.float(), reference(q, kc, vc, tables, lens, d**-0.5, 0), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [0, 300])
def test_long_contexts_split_into_chunks_and_merge(native, window):
    """Contexts past 256 keys are split into chunks at fixed positions, spread over the threads
    and merged: against SDPA, with a sliding window that starts inside a chunk, and a group of
    verification rows that straddles a chunk boundary (each row bit for bit as alone)."""
    g = torch.Generator().manual_seed(5)
    nblocks, bs, hkv, group, d = 160, 16, 3, 3, 64
    kc = torch.randn(nblocks, bs, hkv, d, generator=g)
    vc = torch.randn(nblocks, bs, hkv, d, generator=g)
    lens = torch.tensor([257, 600, 1000, 254, 255, 256, 257, 258, 1999])
    tables = torch.stack([torch.randperm(nblocks - 1, generator=g)[:125] + 1 for _ in lens])
    tables[4:8] = tables[3]  # rows 3-7: one sequence's positions 254..258, across the boundary
    q = torch.randn(len(lens), hkv * group, d, generator=g)
    got = native.paged_decode(q, kc, vc, tables, lens, d**-0.5, window)
    torch.testing.assert_close(got, reference(q, kc, vc, tables, lens, d**-0.5, window), atol=1e-5, rtol=1e-5)
    for i in range(len(lens)):
        alone = native.paged_decode(q[i : i + 1], kc, vc, tables[i : i + 1], lens[i : i + 1], d**-0.5, window)
        assert torch.equal(got[i : i + 1], alone), i


_AT_LEVEL = r"""
import sys, torch
from pagedllm.native import cpu_kernels
ops = cpu_kernels()
cases = torch.load(sys.argv[1])
outs = []
for q, kc, vc, tables, lens, window, ks, vs in cases:
    scales = () if ks is None else (ks, vs)
    together = ops.paged_decode(q, kc, vc, tables, lens, q.shape[-1] ** -0.5, window, *scales)
    alone = [ops.paged_decode(q[i:i + 1], kc, vc, tables[i:i + 1], lens[i:i + 1], q.shape[-1] ** -0.5, window,
                              *scales) for i in range(len(lens))]
    outs.append((together, alone))
torch.save(outs, sys.argv[2])
print(ops.native_isa())
"""


def _reference64(q, k, v, tables, lens, window):
    """Softmax attention in float64 over the dequantized cache, one sequence at a time."""
    hq, d, hkv = q.shape[1], q.shape[2], k.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, n in enumerate(lens.tolist()):
        lo = max(0, n - window) if window > 0 else 0
        ki = k[tables[i]].flatten(0, 1)[lo:n].double().repeat_interleave(hq // hkv, 1)  # [t, hq, d]
        vi = v[tables[i]].flatten(0, 1)[lo:n].double().repeat_interleave(hq // hkv, 1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[i].double(), ki) * d**-0.5, dim=-1)
        out[i] = torch.einsum("ht,thd->hd", p, vi)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("level", ["base", "avx2", "avx512vnni", "avx512bf16"])
def test_each_level_matches_float64_attention_for_every_cache(native, tmp_path, level):
    """paged_decode capped at each x86 level (PAGEDLLM_NATIVE_ISA) against softmax attention in
    float64: float32, bf16, f16, int8 and f8e4m3 caches, head dims 64 and 128 (the blocked paths)
    and 80 (the run-time one), with and without a window, speculative row groups (rows 4-6:
    one sequence's positions) and a context past one chunk; every row bit for bit as alone."""
    from pagedllm.kv.quant import quantize_fp8, quantize_int8

    g = torch.Generator().manual_seed(68)
    nblocks, bs, hkv, group = 48, 16, 2, 3
    lens = torch.tensor([1, 7, 16, 17, 40, 41, 42, 90, 131, 300])
    tables = torch.stack([torch.randperm(nblocks - 1, generator=g)[:19] + 1 for _ in lens])
    tables[5:7] = tables[4]
    cases, refs = [], []
    for cache in ("float32", "bfloat16", "float16", "int8", "f8e4m3"):
        for d in (64, 128, 80):
            k = torch.randn(nblocks, bs, hkv, d, generator=g) * 2
            v = torch.randn(nblocks, bs, hkv, d, generator=g)
            ks = vs = None
            if cache == "int8":
                (kc, ks), (vc, vs) = quantize_int8(k), quantize_int8(v)
                k, v = kc.double() * ks[..., None].double(), vc.double() * vs[..., None].double()
            elif cache == "f8e4m3":
                ks, vs = torch.tensor([0.02, 0.01]), torch.tensor([0.005, 0.01])
                kc, vc = quantize_fp8(k, ks), quantize_fp8(v, vs)
                k, v = kc.double() * ks[:, None].double(), vc.double() * vs[:, None].double()
            else:
                kc, vc = k.to(getattr(torch, cache)), v.to(getattr(torch, cache))
                k, v = kc, vc
            qdtypes = [torch.float32] + ([torch.bfloat16] if cache in ("bfloat16", "int8") else [])
            for qdtype in qdtypes:
                for window in (0, 40):
                    q = torch.randn(len(lens), hkv * group, d, generator=g).to(qdtype)
                    cases.append((q, kc, vc, tables, lens, window, ks, vs))
                    refs.append(_reference64(q, k, v, tables, lens, window))
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, "PAGEDLLM_NATIVE_ISA": level}
    r = subprocess.run(
        [sys.executable, "-c", _AT_LEVEL, str(tmp_path / "cases.pt"), str(tmp_path / "outs.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ran = r.stdout.strip().splitlines()[-1]
    if ran != level:
        pytest.skip(f"capped at {level}, this build and CPU run {ran}")
    for (q, kc, _, _, _, window, _, _), want, (together, alone) in zip(cases, refs, torch.load(tmp_path / "outs.pt")):
        where = f"{kc.dtype}, q {q.dtype}, head dim {q.shape[-1]}, window {window}"
        tol = 1e-5 if q.dtype == torch.float32 else 2e-2
        torch.testing.assert_close(together.double(), want, atol=tol, rtol=tol, msg=lambda m: f"{where}: {m}")
        for i, row in enumerate(alone):
            assert torch.equal(together[i : i + 1], row), f"{where}: row {i} differs from itself alone"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_head,clip", [(True, None), (False, None), (False, 0.8)])
def test_qk_norm_gives_the_rms_norm_ops_values(native, dtype, per_head, clip):
    """The native q/k norm (Qwen3's per head, OLMoE's over whole projections, then its clamp)
    against F.rms_norm on the same splits: float32 within 1e-5, the half types within one
    rounding step; v is untouched unless clamped; a weight of another length is refused."""
    from pagedllm.quant import kernels as qk

    g = torch.Generator().manual_seed(0)
    t, hq, hkv, d = 5, 4, 2, 64
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype)
    n_q, n_k = (d, d) if per_head else (hq * d, hkv * d)
    wq, wk = (torch.rand(n, generator=g).add(0.5).to(dtype) for n in (n_q, n_k))
    got = qk.qk_norm(qkv.clone(), wq, wk, hq, hkv, 1e-6, clip)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    if per_head:
        q = F.rms_norm(q.reshape(t, hq, d), (d,), wq, 1e-6).view(t, hq * d)
        k = F.rms_norm(k.reshape(t, hkv, d), (d,), wk, 1e-6).view(t, hkv * d)
    else:
        q, k = F.rms_norm(q, (hq * d,), wq, 1e-6), F.rms_norm(k, (hkv * d,), wk, 1e-6)
    want = torch.cat((q, k, v), dim=-1)
    if clip is not None:
        want = want.clamp(-clip, clip)
        assert (got.abs() <= clip).all() and (want.abs() == clip).any()
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert not torch.equal(got, qkv)
    with pytest.raises(RuntimeError, match="neither of the head dim"):
        qk.qk_norm(qkv.clone(), wq[:-1], wk, hq, hkv, 1e-6)


def test_kernel_rejects_bad_input(native):
    kc = torch.zeros(4, 8, 2, 64)
    q = torch.zeros(2, 4, 64)
    tables, lens = torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="cache must be in q's dtype"):
        native.paged_decode(q.bfloat16(), kc, kc, tables, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="cache must be in q's dtype"):  # half under bf16: no
        native.paged_decode(q.bfloat16(), kc.half(), kc.half(), tables, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="int32 or int64"):
        native.paged_decode(q, kc, kc, tables.float(), lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        native.paged_decode(torch.zeros(2, 3, 64), kc, kc, tables, lens, 1.0, 0)


GREEDY = """
import json, sys
sys.path.insert(0, {tests!r})
from pagedllm import LLM, SamplingParams
llm = LLM({path!r}, dtype="float32", kv_cache_memory_mb=32, block_size=16, kv_cache_dtype={kv!r})
prompts = [list(range(5 + i, 40 + 9 * i)) for i in range(6)]
out = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
print(json.dumps([llm.engine.backend.decode_kernel, [o.outputs[0].token_ids for o in out]]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["auto", "bf16", "int8", "f8e4m3"])
def test_engine_tokens_same_with_kernel_on_and_off(native, tmp_path, hf_smollm2_tokenizer, kv):
    """A batch of six through chunked prefill and paged decode: the native kernel and the
    PyTorch path give the same greedy tokens, with a float32 cache, with a bf16 one read
    widened and with an int8 or f8e4m3 one scaled as it is read. float32 compute: random weights leave logits so flat
    that bf16 rounding alone (either path's) flips an argmax now and then; the kernel's bf16
    accuracy is checked above against a float32 reference."""
    from models import build_checkpoint

    path = build_checkpoint("llama", tmp_path / "m", hf_smollm2_tokenizer, len(hf_smollm2_tokenizer))
    code = GREEDY.format(tests=os.path.dirname(__file__), path=str(path), kv=kv)
    runs = {}
    for flag in ("1", "0"):
        env = {**os.environ, "PAGEDLLM_NATIVE": flag}
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        runs[flag] = __import__("json").loads(res.stdout.strip().splitlines()[-1])
    assert runs["1"][0] == "native-cpu" and runs["0"][0] == "torch"
    assert runs["1"][1] == runs["0"][1]


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("n,k,bias", [(960, 576, True), (49152, 64, False), (77, 1536, False)])
def test_small_batch_linear_matches_float_reference(native, rows, n, k, bias):
    from pagedllm.models.linear import Linear

    g = torch.Generator().manual_seed(n + k + rows)
    layer = Linear(k, n, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        got = layer(x)
        direct = native.linear_small_m(x, layer.weight)
    want = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # Both sum in float32; the only rounding is the bf16 result (and the bf16 bias add).
    torch.testing.assert_close(got.float(), want, atol=0.05 * want.abs().max().item() / 8, rtol=1e-2)
    torch.testing.assert_close(direct.float(), F.linear(x.float(), layer.weight.float()), atol=0.2, rtol=8e-3)
    with pytest.raises(RuntimeError, match="M = 1 or 2"):
        native.linear_small_m(torch.zeros(3, k, dtype=torch.bfloat16), layer.weight)
    with pytest.raises(RuntimeError, match="bfloat16"):
        native.linear_small_m(x.float(), layer.weight.float())


def test_batch1_logits_same_with_gemv_on_and_off(native, tmp_path, hf_smollm2_tokenizer, monkeypatch):
    """Token-by-token scoring runs the decode path at batch 1, where every linear layer takes
    the native matrix-vector product; with it turned off oneDNN does the same products."""
    from models import build_checkpoint

    from pagedllm import LLM
    import pagedllm.models.linear as linear

    path = build_checkpoint("qwen2", tmp_path / "m", hf_smollm2_tokenizer, len(hf_smollm2_tokenizer))
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory_mb=16)
    prompt = list(range(300, 360))

    class Counting:  # the native module, counting its matrix-vector products
        calls = 0

        def linear_small_m(self, x, w):
            Counting.calls += 1
            return native.linear_small_m(x, w)

    monkeypatch.setattr(linear, "cpu_kernels", lambda: Counting())
    on = llm.prompt_logits(prompt, chunk_size=1)
    # Every projection of every token took the native path: qkv, o, gate_up, down per layer, and the head.
    assert Counting.calls == len(prompt) * (4 * llm.engine.model_config.num_layers + 1)
    monkeypatch.setattr(linear, "cpu_kernels", lambda: None)
    off = llm.prompt_logits(prompt, chunk_size=1)
    scale = off.std().item()
    assert (on - off).abs().mean().item() < 0.02 * scale  # the two paths agree to bf16 rounding
    # Against transformers in float32: both bf16 paths pick its token wherever its top two are
    # further apart than bf16 rounding can move them; only near-ties may differ.
    ref = _transformers_logits(path, prompt)
    for got in (on, off):
        assert_argmax_where_clear(got, ref, margin=0.1 * scale)


def _transformers_logits(path, prompt: list[int]) -> torch.Tensor:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def assert_argmax_where_clear(got: torch.Tensor, ref: torch.Tensor, margin: float) -> None:
    """got's argmax equals ref's at every row whose top-two gap exceeds `margin`, and such rows
    are most rows (the check is not vacuous)."""
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > margin
    assert clear.float().mean().item() > 0.5, f"only {int(clear.sum())} of {len(clear)} rows are clear"
    bad = (got.argmax(-1) != ref.argmax(-1)) & clear
    assert not bad.any(), f"rows {bad.nonzero()[:, 0].tolist()} pick another token than the reference"


@pytest.mark.parametrize("vocab", [1000, 49152, 262147])
def test_sample_topk_matches_torch(vocab):
    """The sampler's native first pass: torch.topk's values and ids (distinct values), and the
    softmax denominator at temperature T, also for rows with fewer finite logits than k."""
    ops = cpu_kernels()
    if ops is None:
        pytest.skip("native kernels not built here")
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=g) * 4
    x[1, 7:] = float("-inf")  # a grammar-masked row: 7 allowed tokens, k = 64
    temps = torch.tensor([0.7, 1.0, 1.3, 0.2, 2.0])
    vals, ids, total = ops.sample_topk(x, temps, 64)
    want_v, want_i = x.topk(64, dim=-1)
    assert torch.equal(vals, want_v)
    assert torch.equal(ids[:, :7], want_i[:, :7]) and torch.equal(ids[[0, 2, 3, 4]], want_i[[0, 2, 3, 4]])
    assert len(set(ids[1].tolist())) == 64  # padding ids are distinct
    ref = torch.exp((x.double() - x.max(-1, keepdim=True).values.double()) / temps[:, None].double()).sum(-1)
    assert torch.allclose(total.double(), ref, rtol=1e-5)
    # The later levels: many candidates, chosen rows, no sum (a threshold estimated from a sample
    # of the row, with the general path behind it).
    rows = torch.tensor([4, 0, 2])
    for k in (256, min(4096, vocab)):
        vals, ids, total = ops.sample_topk(x, temps[rows], k, rows, False)
        want_v, _ = x[rows].topk(k, dim=-1)
        assert total.numel() == 0 and torch.equal(vals, want_v)
        assert torch.equal(x[rows].gather(1, ids), vals)  # ids hold those values (ties in any order)
        assert all(len(set(r.tolist())) == k for r in ids)
    with pytest.raises(RuntimeError, match="k = 0"):
        ops.sample_topk(x, temps, 0)


def _prefill_reference(q, kc, vc, table, ctx, scale, window):
    """float64 attention of the chunk's queries (the last n positions) over its gathered context."""
    n, hq, d = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    j = torch.arange(ctx)
    slots = table[j // bs] * bs + j % bs
    k, v = kc.view(-1, hkv, d)[slots].double(), vc.view(-1, hkv, d)[slots].double()
    pos = torch.arange(ctx - n, ctx)[:, None]
    m = j[None] <= pos
    if window:
        m &= j[None] > pos - window
    return F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=m, scale=scale, enable_gqa=hq != hkv
    ).transpose(0, 1)


@pytest.mark.parametrize(
    "n,ctx,hq,hkv,d,window",
    [
        (512, 512, 9, 3, 64, 0),
        (37, 300, 14, 2, 64, 0),
        (100, 100, 8, 8, 128, 0),
        (70, 260, 16, 2, 128, 48),
        (1, 1, 4, 2, 64, 0),
        (129, 200, 6, 1, 96, 0),
    ],
)
def test_prefill_kernel_matches_float64_attention(native, n, ctx, hq, hkv, d, window):
    """The bf16 prefill kernel against float64 attention on the same bf16 values: a chunk after
    a cached prefix, sliding windows, GQA groups of 1 to 7, tiles and key blocks cut short.
    Slots past the context hold NaN (never-written cache): they must not reach the output."""
    if not native.paged_prefill_available():
        pytest.skip("this CPU has no AVX-512 BF16: prefill attention stays on SDPA")
    g = torch.Generator().manual_seed(n + ctx)
    bs = 32
    used = (ctx + bs - 1) // bs
    kc = torch.randn(used + 4, bs, hkv, d, generator=g).bfloat16()
    vc = torch.randn(used + 4, bs, hkv, d, generator=g).bfloat16()
    table = torch.cat([torch.randperm(used + 3, generator=g)[:used] + 1, torch.zeros(3, dtype=torch.long)])
    last = table[(ctx - 1) // bs]
    kc[last, (ctx - 1) % bs + 1 :] = float("nan")
    vc[last, (ctx - 1) % bs + 1 :] = float("nan")
    q = torch.randn(n, hq, 2 * d, generator=g).bfloat16()[..., :d]  # strided, as from the fused qkv
    got = native.paged_prefill(q, kc, vc, table.int(), ctx, d**-0.5, window)
    want = _prefill_reference(q, kc, vc, table, ctx, d**-0.5, window)
    assert got.dtype == torch.bfloat16 and got.shape == (n, hq, d) and torch.isfinite(got).all()
    # bf16 output rounding (2^-9 relative) plus the probabilities rounded to bf16, as SDPA does.
    torch.testing.assert_close(got.double(), want, atol=1.5e-2, rtol=1.5e-2)


@pytest.mark.parametrize("cache", ["int8", "f8e4m3"])
@pytest.mark.parametrize(
    "n,ctx,hq,hkv,d,window", [(37, 300, 14, 2, 64, 0), (70, 260, 16, 2, 128, 48), (129, 200, 6, 1, 96, 0)]
)
def test_prefill_kernel_reads_quantized_caches(native, cache, n, ctx, hq, hkv, d, window):
    """An int8 cache (per-token scales) and an f8e4m3 cache (per-head scales) read in place:
    against float64 attention over the same stored values times their scales. Slots past the
    context hold NaN scales (int8) or NaN bytes (f8e4m3): they must not reach the output; the
    scales must be read (doubling them changes the output)."""
    if not native.paged_prefill_available():
        pytest.skip("this CPU has no AVX-512 BF16: prefill attention stays on SDPA")
    from pagedllm.kv.quant import quantize_fp8, quantize_int8

    g = torch.Generator().manual_seed(n + ctx + d)
    bs = 32
    used = (ctx + bs - 1) // bs
    k = torch.randn(used + 4, bs, hkv, d, generator=g) * 3
    v = torch.randn(used + 4, bs, hkv, d, generator=g)
    if cache == "int8":
        (kc, ks), (vc, vs) = quantize_int8(k), quantize_int8(v)
        kf, vf = kc.double() * ks.double()[..., None], vc.double() * vs.double()[..., None]
    else:
        ks, vs = torch.rand(hkv, generator=g) * 0.02 + 0.005, torch.rand(hkv, generator=g) * 0.01 + 0.002
        kc, vc = quantize_fp8(k, ks), quantize_fp8(v, vs)
        kf, vf = kc.double() * ks.double()[:, None], vc.double() * vs.double()[:, None]
    table = torch.cat([torch.randperm(used + 3, generator=g)[:used] + 1, torch.zeros(3, dtype=torch.long)])
    last = table[(ctx - 1) // bs]
    if cache == "int8":
        ks[last, (ctx - 1) % bs + 1 :] = float("nan")
        vs[last, (ctx - 1) % bs + 1 :] = float("nan")
    else:
        kc.view(torch.uint8)[last, (ctx - 1) % bs + 1 :] = 0x7F  # e4m3's NaN
        vc.view(torch.uint8)[last, (ctx - 1) % bs + 1 :] = 0x7F
    q = torch.randn(n, hq, 2 * d, generator=g).bfloat16()[..., :d]
    got = native.paged_prefill(q, kc, vc, table, ctx, d**-0.5, window, ks, vs)
    want = _prefill_reference(q, kf.float(), vf.float(), table, ctx, d**-0.5, window)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    # The keys and values are rounded to bf16 as they are packed (2^-9 relative), then as above.
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    doubled = native.paged_prefill(q, kc, vc, table, ctx, d**-0.5, window, ks, vs * 2)
    torch.testing.assert_close(doubled.double(), 2 * got.double(), atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match="needs k_scale and v_scale"):
        native.paged_prefill(q, kc, vc, table, ctx, d**-0.5, window)
    with pytest.raises(RuntimeError, match="must be contiguous float32"):
        native.paged_prefill(q, kc, vc, table, ctx, d**-0.5, window, ks.double(), vs)


def test_prefill_kernel_rejects_bad_input(native):
    if not native.paged_prefill_available():
        pytest.skip("this CPU has no AVX-512 BF16")
    kc = torch.zeros(4, 8, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    table = torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match="outside the pool"):
        native.paged_prefill(q, kc, kc, torch.tensor([1, 9]), 10, 1.0, 0)
    with pytest.raises(RuntimeError, match="needs 3 blocks"):
        native.paged_prefill(q, kc, kc, table, 20, 1.0, 0)
    with pytest.raises(RuntimeError, match="cannot end a context"):
        native.paged_prefill(q, kc, kc, table, 2, 1.0, 0)
    with pytest.raises(RuntimeError, match="bfloat16"):
        native.paged_prefill(q.float(), kc, kc, table, 5, 1.0, 0)


@pytest.mark.parametrize(
    "family,cache", [("llama", "auto"), ("mistral", "auto"), ("llama", "int8"), ("mistral", "f8e4m3")]
)
def test_engine_prefill_on_the_kernel_matches_sdpa(native, tmp_path, hf_smollm2_tokenizer, monkeypatch, family, cache):
    """A bf16 model's prompt logits, whole and in chunks after a cached prefix (the kernel reads
    the prefix in place; Mistral's 48-token window cuts it), against the same engine with
    prefill attention on SDPA, for a bf16 cache and the quantized ones (read and scaled in
    place). Head dim 64: the kernel takes head dims in 32s."""
    if not native.paged_prefill_available():
        pytest.skip("this CPU has no AVX-512 BF16")
    from models import build_checkpoint

    from pagedllm import LLM
    from pagedllm.attention import paged

    path = build_checkpoint(
        family,
        tmp_path / "m",
        hf_smollm2_tokenizer,
        len(hf_smollm2_tokenizer),
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    )
    prompt = list(range(20, 320))
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory_mb=16, kv_cache_dtype=cache)
    assert "prefill chunks use the native bf16 prefill kernel" in llm.kv_cache_trace().decode_attention
    got = {c: llm.prompt_logits(prompt, c).float() for c in (300, 64)}
    monkeypatch.setattr(paged, "native_prefill", lambda *a: False)
    want = {c: llm.prompt_logits(prompt, c).float() for c in (300, 64)}
    for c in got:
        scale = want[c].std()
        # Measured: 1.0-1.1% with a bf16 cache, 1.9-2.1% with int8 / f8e4m3, whose PyTorch read
        # multiplies in bf16 by a bf16-rounded scale (up to 2^-9 off for a whole row or head)
        # where the kernel rounds the float32 product once. Scales left out would be far off.
        assert ((got[c] - want[c]).abs().mean() / scale) < (0.02 if cache == "auto" else 0.03), c
        assert (got[c].argmax(-1) == want[c].argmax(-1)).float().mean() > 0.9, c


@pytest.mark.parametrize("family,dtype", [("llama", "float32"), ("llama", "bfloat16"), ("gemma2", "float32")])
def test_trace_names_the_attention_path_the_layers_take(native, tmp_path, hf_smollm2_tokenizer, family, dtype):
    """Gemma 2's layers cap their scores, which the native kernels cannot: its trace must name the
    PyTorch path they take (and say why), not the native kernels. A bf16 model's trace says whether
    the scores run on vdpbf16ps, as the kernel decides it."""
    from models import build_checkpoint

    from pagedllm import LLM

    # bf16: heads of 64, a head dim the kernel unrolls.
    wide = {"hidden_size": 128, "num_attention_heads": 2, "head_dim": 64} if dtype == "bfloat16" else {}
    path = build_checkpoint(family, tmp_path / "m", hf_smollm2_tokenizer, len(hf_smollm2_tokenizer), **wide)
    llm = LLM(str(path), dtype=dtype, kv_cache_memory_mb=16)
    decode = llm.kv_cache_trace().decode_attention
    head_dim = llm.engine.kv_cache.spec.head_dim
    bf16_scores = dtype == "bfloat16" and head_dim in (64, 128) and native.paged_decode_bf16_scores()
    assert ("vdpbf16ps" in decode) == bool(bf16_scores), decode
    assert head_dim == (64 if dtype == "bfloat16" else 16)
    on_native = [a.attn.native is not None for a in llm.engine.model.attention_modules()]
    assert any(on_native) == ("native CPU decode kernel" in decode), decode
    assert all(on_native) == (family == "llama")
    if family == "gemma2":
        assert decode.startswith("torch-paged: all decodes") and "cap" in decode, decode


_OMP_THREADS = r"""
import os, sys, threading, time, torch
torch.set_num_threads(2)
from pagedllm import LLM, SamplingParams
from pagedllm.native import release_omp_threads

def tasks(expect=None):  # the process's threads; an exiting worker may take a moment to go
    for _ in range(200):
        n = len(os.listdir("/proc/self/task"))
        if expect is None or n == expect:
            return n
        time.sleep(0.01)
    return n

x = torch.ones(1 << 23)
def parallel_op():  # an elementwise op this large opens an OpenMP parallel region
    (x + 1).sum()

parallel_op(); held = tasks(); release_omp_threads(); freed = tasks(held - 1); parallel_op(); again = tasks()
llm = LLM(sys.argv[1], seed=0, kv_cache_context_len=256, max_model_len=256)
loaded = tasks(); parallel_op(); remade = tasks(); release_omp_threads(); tasks(loaded)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
after_generate = tasks(loaded)
th = threading.Thread(target=lambda: llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False))
th.start(); th.join()
print(held, freed, again, loaded, remade, after_generate, tasks(loaded))
"""


@pytest.mark.slow
def test_threads_that_stop_driving_the_engine_let_their_openmp_workers_go(native, smollm2_gguf_path):
    # libgomp makes idle workers sleep instead of spin once it manages more threads than CPUs:
    # a model loaded on one thread and run on another ran its decode stack 2.4x slower. So the
    # loading thread, and a thread whose engine has gone idle, hold no OpenMP workers.
    env = dict(os.environ, OMP_NUM_THREADS="2")
    res = subprocess.run(
        [sys.executable, "-c", _OMP_THREADS, str(smollm2_gguf_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    held, freed, again, loaded, remade, after_generate, after_thread = map(int, res.stdout.split()[-7:])
    assert freed == held - 1 and again == held  # the call lets this thread's one worker go
    assert remade == loaded + 1  # loaded, the loading thread held no worker: a parallel op made one
    assert after_generate == loaded  # the engine went idle on this thread: its worker went
    assert after_thread == loaded  # the other thread's went with it


def _cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as fh:
            return "avx512_bf16" in fh.read().split()
    except OSError:
        return False


@pytest.mark.slow
def test_bf16_scores_follow_the_cpu_and_the_level_cap(native, tmp_path):
    """The scores of a bf16 query against a bf16 cache run on vdpbf16ps where the CPU has AVX-512
    BF16 and PAGEDLLM_NATIVE_ISA does not cap the kernels below it; a process capped at
    avx512vnni takes the float32 path, and the two agree within bf16's rounding."""
    cap = os.environ.get("PAGEDLLM_NATIVE_ISA")
    assert native.paged_decode_bf16_scores() == (_cpu_has_bf16() and cap in (None, "avx512bf16"))
    g = torch.Generator().manual_seed(5)
    nblocks, bs, n, hkv, group = 40, 16, 6, 2, 6
    for d in (64, 128):
        kc = torch.randn(nblocks, bs, hkv, d, generator=g).bfloat16()
        vc = torch.randn(nblocks, bs, hkv, d, generator=g).bfloat16()
        q = torch.randn(n, hkv * group, d, generator=g).bfloat16()
        lens = torch.tensor([1, 15, 33, 130, 257, 300])
        tables = torch.randint(1, nblocks, (n, 19), generator=g)
        torch.save((q, kc, vc, tables, lens), tmp_path / f"in{d}.pt")
    script = (
        "import sys, torch\n"
        "from pagedllm.native import cpu_kernels\n"
        "ops = cpu_kernels()\n"
        "outs = {}\n"
        "for d in (64, 128):\n"
        f"    q, kc, vc, tables, lens = torch.load(r'{tmp_path}/in' + str(d) + '.pt')\n"
        "    outs[d] = ops.paged_decode(q, kc, vc, tables, lens, d ** -0.5, 0)\n"
        f"torch.save(outs, r'{tmp_path}/capped.pt')\n"
        "print(ops.paged_decode_bf16_scores())\n"
    )
    env = {**os.environ, "PAGEDLLM_NATIVE_ISA": "avx512vnni"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False", r.stdout
    capped = torch.load(tmp_path / "capped.pt")
    for d in (64, 128):
        q, kc, vc, tables, lens = torch.load(tmp_path / f"in{d}.pt")
        got = native.paged_decode(q, kc, vc, tables, lens, d**-0.5, 0)
        want = reference(q, kc, vc, tables, lens, d**-0.5, 0)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
        # One bf16 unit in the last place apart at most, and rarely.
        diff = (got.float() - capped[d].float()).abs()
        assert (diff <= want.abs() * 2**-7 + 1e-6).all(), diff.max()
        assert (got != capped[d]).float().mean() < 0.01


_STALE = """
import logging
import pagedllm.native as native
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
native.NATIVE_ABI += 1  # this code now calls an op set the built library does not have
first, again = native.cpu_kernels(), native.cpu_kernels()
from pagedllm.quant.kernels import decode_layers_available, kernel_path
print("LOADED", first is not None or again is not None, decode_layers_available(), kernel_path()[0])
"""


@pytest.mark.slow
def test_a_library_of_another_op_set_is_refused_with_how_to_rebuild(native):
    # The library stamps its op set (csrc/dispatch.cpp); a build whose stamp is not the one the
    # Python side calls is a stale build: not used at all, with one warning that says how to
    # rebuild, rather than some ops probed and others crashing.
    from pagedllm.native import NATIVE_ABI

    assert int(native.native_abi()) == NATIVE_ABI  # this build is the one the code calls
    res = subprocess.run([sys.executable, "-c", _STALE], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "LOADED False False None" in res.stdout
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("WARNING")]
    assert len(warnings) == 1, res.stderr
    assert "stale build" in warnings[0] and "make kernels" in warnings[0] and "pip install" in warnings[0]
