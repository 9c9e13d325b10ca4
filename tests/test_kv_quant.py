"""KV-cache quantization (int8, f8e4m3) and half-width storage (bf16, f16): round trips,
capacity, logits and generation vs auto."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import CacheConfig
from pagedllm.kv.cache import KVCacheSpec, PagedKVCache, plan_cache
from pagedllm.kv.calibration import HEADROOM, checkpoint_fp8_scales, kv_scale_key, scales_from_amax
from pagedllm.kv.quant import (
    FP8_MAX,
    KVCodec,
    _fp8_as,
    dequantize_fp8,
    dequantize_int8,
    get_mode,
    quantize_fp8,
    quantize_int8,
)
from models import build_checkpoint

QUANT = ["int8", "f8e4m3"]
HALF = ["bf16", "f16"]  # stored as half-width floats, read back widened
CPU = torch.device("cpu")


def _kv(n: int = 300, heads: int = 2, dim: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, dim, generator=g)
    x[::7] *= 20  # tokens of very different size: the per-token scale must follow them
    x[3, 1] = 0  # an all-zero (token, head)
    x[5, 0, 7] = 300  # an outlier channel
    return x


# -- round trips ------------------------------------------------------------
def test_int8_round_trip_bound():
    x = _kv()
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == x.shape[:-1]
    back = dequantize_int8(q, s, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    # Round to nearest: at most half a step (amax / 127 / 2) per element, per (token, head).
    assert ((back - x).abs() <= amax / 254 * (1 + 1e-5) + 1e-12).all()
    assert torch.equal(back[3, 1], torch.zeros(64))
    # Into bfloat16: the same bound plus one bf16 rounding of the value and of the scale.
    b = dequantize_int8(q, s, torch.bfloat16).float()
    assert ((b - x).abs() <= amax / 254 + (x.abs() + amax) * 2**-8).all()


def test_fp8_codes_read_back_exactly():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    ref = codes.float()
    finite = ~torch.isnan(ref)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        t, factor = _fp8_as(codes, dt)
        assert torch.equal((t.double() * factor).float()[finite], ref[finite]), dt


def test_fp8_round_trip_bound_and_saturation():
    x = _kv()
    scale = torch.tensor([0.05, 0.5])
    q = quantize_fp8(x, scale)
    assert q.dtype == torch.float8_e4m3fn
    back = dequantize_fp8(q, scale, torch.float32)
    assert torch.isfinite(back).all()
    lim = FP8_MAX * scale[None, :, None]
    inside = x.abs() <= lim
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals; below 2^-6 * scale
    # (subnormals) the absolute error is at most half their step, 2^-10 * scale.
    err = (back - x).abs()
    bound = torch.maximum(x.abs() * 2**-4, 2**-10 * scale[None, :, None].expand_as(x))
    assert (err[inside] <= bound[inside] * (1 + 1e-6)).all()
    # Beyond the range: clamped to +-448 * scale, never inf or NaN.
    assert (~inside).any()
    assert torch.equal(back[~inside], (torch.sign(x) * lim.expand_as(x))[~inside])
    for dt in (torch.bfloat16, torch.float16):
        assert torch.allclose(dequantize_fp8(q, scale, dt).float(), back, rtol=2**-7, atol=0)


def test_auto_is_the_compute_dtype_unchanged():
    codec = KVCodec(get_mode("auto"))
    x = _kv().bfloat16()
    data, s = codec.encode(x, 0)
    assert s is None and data is x
    assert codec.decode(data, None, 0, torch.bfloat16) is x


def test_fp8_scales_from_amax():
    amax = torch.tensor([[1e-3, 3.0, 447.9, 0.0]])
    s = scales_from_amax(amax)
    assert torch.equal(torch.log2(s), torch.log2(s).round())  # powers of two
    assert (amax * HEADROOM <= FP8_MAX * s).all()  # calibration max x headroom still fits
    assert (amax * HEADROOM * 2 > FP8_MAX * s)[:, :3].all()  # and not more than 2x spare
    assert s[0, 3] == 1.0


# -- modes, validation, capacity ----------------------------------------------
def test_kv_cache_dtype_is_validated():
    with pytest.raises(ValueError, match=r"auto\|bf16\|f16\|f8e4m3\|int8"):
        CacheConfig(kv_cache_dtype="fp4").validate()
    CacheConfig(kv_cache_dtype="INT8").validate()
    CacheConfig(kv_cache_dtype="F16").validate()
    with pytest.raises(ValueError, match=r"auto\|bf16\|f16\|f8e4m3\|int8"):
        get_mode("e5m2")


@pytest.mark.parametrize("compute,ratio_f8", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_capacity_ratios_count_the_scales(compute, ratio_f8):
    layers, heads, dim, bs = 30, 3, 64, 32  # SmolLM2-135M's cache shape
    cfg = CacheConfig(block_size=bs, kv_cache_memory_mb=256)
    blocks = {}
    for ct in ("auto", "bf16", "f16", "f8e4m3", "int8"):
        spec = KVCacheSpec(layers, heads, dim, bs, compute, ct)
        blocks[ct] = plan_cache(spec, cfg, CPU, 1, 1).num_blocks - 1
        if ct == "int8":  # per-token scales are paid for: 4 bytes per (token, head) for K and V
            assert spec.bytes_per_token == 2 * layers * heads * (dim + 4)
    assert abs(blocks["f8e4m3"] / blocks["auto"] - ratio_f8) < 0.01
    # Half-width floats: half of a float32 cache, the same as a bfloat16 one.
    assert abs(blocks["bf16"] / blocks["auto"] - ratio_f8 / 2) < 0.01 and blocks["f16"] == blocks["bf16"]
    # int8 gets the f8 ratio less what its scales take: dim / (dim + 4) of it.
    assert abs(blocks["int8"] / blocks["auto"] - ratio_f8 * dim / (dim + 4)) < 0.01
    for ct in ("bf16", "f16", "f8e4m3", "int8"):
        spec = KVCacheSpec(layers, heads, dim, bs, compute, ct)
        cache = PagedKVCache(spec, blocks[ct] + 1, CPU, torch.ones(layers, 2, heads))
        assert cache.nbytes <= 256 * 2**20 + spec.bytes_per_block  # + the null block
        assert cache.data.dtype == spec.dtype == get_mode(ct).storage_dtype


@pytest.mark.parametrize("ct", QUANT + HALF)
def test_block_copies_carry_values_and_scales(ct):
    spec = KVCacheSpec(2, 2, 16, 8, torch.float32, ct)
    cache = PagedKVCache(spec, 6, CPU, torch.full((2, 2, 2), 0.125))
    for i in range(2):
        kv = cache.layer(i)
        slots = torch.arange(8, 24)  # blocks 1 and 2
        kv.write(_kv(16, 2, 16, seed=i), _kv(16, 2, 16, seed=i + 5), slots)
    cache.copy_blocks(torch.tensor([1, 2]), torch.tensor([3, 4]))
    untouched = [t[:, :, 5, 3:].clone() for t in cache._block_tensors()]
    cache.copy_block_prefix(1, 5, 3)
    for i in range(2):
        kv = cache.layer(i)
        slots = torch.tensor([1, 2, 3, 4, 5])[:, None] * 8 + torch.arange(8)
        k, v = kv.read(slots, torch.float32)  # [5, 8, H, D]
        assert torch.equal(k[2:4], k[0:2]) and torch.equal(v[2:4], v[0:2])
        assert torch.equal(k[4, :3], k[0, :3]) and torch.equal(v[4, :3], v[0, :3])
        assert not torch.equal(k[0], torch.zeros_like(k[0]))
    # The partial copy writes its 3 slots only (the rest of a lazily allocated block stays unwritten).
    # Compared as bits: the unwritten slots hold whatever the allocator left there, NaN patterns
    # included, and NaN != NaN as floats.
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    assert all(
        torch.equal(t[:, :, 5, 3:].view(bits[t.element_size()]), u.view(bits[u.element_size()]))
        for t, u in zip(cache._block_tensors(), untouched)
    )


# -- through the engine, random weights -------------------------------------------
@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory, hf_smollm2_tokenizer):
    tok = hf_smollm2_tokenizer
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama-q"), tok, len(tok))


@pytest.fixture(scope="module")
def mistral_ckpt(tmp_path_factory, hf_smollm2_tokenizer):
    tok = hf_smollm2_tokenizer
    return build_checkpoint("mistral", tmp_path_factory.mktemp("mistral-q"), tok, len(tok))


@pytest.fixture(scope="module")
def gemma3_ckpt(tmp_path_factory, hf_smollm2_tokenizer):
    tok = hf_smollm2_tokenizer
    return build_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3-q"), tok, len(tok))


def _prompts(n: int, vocab: int, lens=(5, 40, 90, 150), seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lens[i % len(lens)],), generator=g).tolist() for i in range(n)]


# Logits token by token through the paged decode path vs auto (float32). The random-weight
# model amplifies small errors (running it in bfloat16 moves its logits by about 1.5% of their
# spread on average), so the tolerance is stated against that: int8 must stay within 1.5x of
# bfloat16 compute's error, f8e4m3 (3 mantissa bits) within 6x.
VS_BF16 = {"int8": 1.5, "f8e4m3": 6.0, "bf16": 1.0, "f16": 0.3}


@pytest.fixture(scope="module")
def llama_ref(llama_ckpt):
    prompt = _prompts(1, 1000, lens=(80,))[0]
    ref = LLM(str(llama_ckpt), dtype="float32", kv_cache_memory_mb=8).prompt_logits(prompt, 1)
    bf16 = LLM(str(llama_ckpt), dtype="bfloat16", kv_cache_memory_mb=8).prompt_logits(prompt, 1)
    return prompt, ref, (bf16 - ref).abs().mean() / ref.std()


@pytest.mark.parametrize("ct", QUANT + HALF)
def test_logits_close_to_auto(llama_ckpt, llama_ref, ct):
    prompt, ref, bf16_err = llama_ref
    llm = LLM(str(llama_ckpt), dtype="float32", kv_cache_memory_mb=8, kv_cache_dtype=ct)
    got = llm.prompt_logits(prompt, 1)
    assert torch.isfinite(got).all()
    err = ((got - ref).abs().mean() / ref.std()).item()
    assert 0 < err < VS_BF16[ct] * bf16_err, (
        f"{ct}: mean logit error {err:.4f} x std (bfloat16 compute: {bf16_err:.4f})"
    )
    assert (got - ref).abs().max() / ref.std() < {"int8": 0.4, "f8e4m3": 1.5, "bf16": 0.4, "f16": 0.1}[ct]
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > {"int8": 0.9, "f8e4m3": 0.8, "bf16": 0.9, "f16": 0.95}[
        ct
    ]
    # Scoring many prompts at once gives the same log-probs as one at a time, and chunked
    # prefill reads the same stored values as token-by-token decode. Not bit for bit: another
    # batch shape rounds K/V differently in float32, which now and then moves a value to the
    # neighbouring quantization step.
    lp = llm.score_prompts([prompt, prompt[:50]], chunk_size=1)
    want = got[:-1].log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    for a, b in ((lp[0], want), (lp[1], lp[0][:49]), (llm.prompt_logits(prompt, 16), got)):
        assert (a - b).abs().mean() < 2e-3 and (a - b).abs().max() < 0.05
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def _greedy(llm: LLM, prompts, n: int = 16) -> list[list[int]]:
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


def _no_leaks(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.requests and not eng.scheduler.has_unfinished()
    if not eng.cache_config.paged_attention:
        assert eng.backend.num_seqs_held == 0
    bm = eng.block_manager
    # Free or evictable (a prefix cache may keep content in blocks nobody references).
    assert bm.num_free_blocks == bm.num_usable_blocks
    bm.check_invariants([])


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
@pytest.mark.parametrize("ct", QUANT + ["f16"])
def test_generate_preempt_window_contiguous(request, family, ct):
    """Mistral slides a 48-token window; Gemma 3 mixes such layers with a global one (KV
    groups); a tiny cache forces preemption; the contiguous backend stores the same quantized
    values. Every attention reads K/V back from the cache, so all three give the same tokens;
    none leaks a block."""
    mistral_ckpt = request.getfixturevalue(f"{family}_ckpt")
    prompts = _prompts(4, 1000)
    runs = {
        "paged": dict(kv_cache_memory_mb=8),
        "preempt": dict(block_size=8, max_num_batched_tokens=64, kv_cache_context_len=160),
        "contiguous": dict(paged_attention=False, kv_cache_memory_mb=8),
    }
    outs = {}
    for name, kw in runs.items():
        llm = LLM(str(mistral_ckpt), dtype="float32", kv_cache_dtype=ct, **kw)
        outs[name] = _greedy(llm, prompts)
        _no_leaks(llm)
        if name == "preempt":
            assert llm.engine.scheduler.num_preemptions > 0
    assert all(len(t) == 16 for t in outs["paged"])
    assert outs["preempt"] == outs["paged"]
    assert outs["contiguous"] == outs["paged"]


@pytest.mark.parametrize("ct", QUANT + ["bf16"])
def test_prefix_cache_reuses_quantized_blocks(llama_ckpt, ct):
    shared = _prompts(1, 1000, lens=(100,), seed=3)[0]
    prompts = [shared + t for t in _prompts(4, 1000, lens=(3, 9), seed=4)]
    llm = LLM(str(llama_ckpt), dtype="float32", kv_cache_memory_mb=8, kv_cache_dtype=ct)
    first = _greedy(llm, prompts)
    second = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    if getattr(llm.engine, "prefix_caching", False):
        assert any(o.num_cached_tokens > 0 for o in second)
    assert [list(o.outputs[0].token_ids) for o in second] == first
    _no_leaks(llm)


def test_checkpoint_fp8_scales_are_used(tmp_path, hf_smollm2_tokenizer):
    from safetensors.torch import load_file, save_file

    tok = hf_smollm2_tokenizer
    path = build_checkpoint("qwen2", tmp_path / "q", tok, len(tok))
    f = next(path.glob("*.safetensors"))
    tensors = load_file(str(f))
    for i in range(3):  # 3 layers, 2 kv heads: per-head K scales, one scalar V scale
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([0.25, 0.5])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.125)
    save_file(tensors, str(f), metadata={"format": "pt"})
    assert kv_scale_key("model.layers.2.self_attn.v_scale") == (2, 1)
    assert kv_scale_key("model.layers.2.self_attn.q_proj.weight") is None

    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=4, kv_cache_dtype="f8e4m3")
    eng = llm.engine
    assert eng.kv_spec.scale_source == "checkpoint"
    hs = eng.kv_cache.head_scales.cpu()
    assert torch.equal(hs[:, 0], torch.tensor([[0.25, 0.5]] * 3))
    assert torch.equal(hs[:, 1], torch.full((3, 2), 0.125))
    assert len(_greedy(llm, _prompts(2, 1000), n=4)[0]) == 4
    # The same checkpoint loads for the other cache types (scales are set aside).
    assert LLM(str(path), dtype="float32", kv_cache_memory_mb=4).engine.kv_spec.dtype == torch.float32
    assert checkpoint_fp8_scales({(0, 0): torch.tensor(1.0)}, 2, 2) is None  # incomplete: calibrate


def test_trace_reports_the_quantization(llama_ckpt):
    llm = LLM(str(llama_ckpt), dtype="float32", kv_cache_memory_mb=4, kv_cache_dtype="f8e4m3")
    eng = llm.engine
    info = eng.cache_plan.info(eng.kv_spec)
    assert info["kv_cache_dtype"] == "f8e4m3" and info["dtype"] == "float8_e4m3fn"
    assert info["quant_mode"] and info["scale_granularity"] == "per-layer-head"
    assert info["scale_source"].startswith("calibrated")
    assert info["capacity_tokens"] == eng.block_manager.num_usable_blocks * 32
    text = eng.cache_plan.describe(eng.kv_spec)
    assert "f8e4m3" in text and "per-layer-head" in text and "token slots" in text


@pytest.mark.slow
def test_calibrated_fp8_scales_leave_room_for_unseen_text(smollm2_gguf_path):
    """The f8e4m3 scales come from one paragraph; English they never saw must fit well inside
    them. On the default model the last layer's V reaches 2.7x the paragraph's maximum on the
    quality bench's text, which saturated that head at the former headroom of 2."""
    import argparse

    from pagedllm.attention.calibration import calibrate_kv_amax
    from pagedllm.bench.quality import _prepare_text

    eng = LLM(str(smollm2_gguf_path), kv_cache_memory_mb=8, kv_cache_dtype="f8e4m3").engine
    assert eng.kv_spec.scale_source.startswith("calibrated")
    limit = FP8_MAX * eng.kv_cache.head_scales.cpu()  # [layers, 2, H]: where values saturate
    args = argparse.Namespace(
        text_file=None, windows=8, window_len=512, prompts=0, prompt_len=0, model=str(smollm2_gguf_path)
    )
    amax = torch.zeros_like(limit)
    for w in _prepare_text(args)[0]:
        amax = torch.maximum(amax, calibrate_kv_amax(eng.model, w, CPU))
    # At least 4x spare on text the calibration never saw (at headroom 2 it was under 1x).
    assert (amax < limit / 4).all(), (amax / limit).amax().item()


# -- the quality bench's pieces ---------------------------------------------------
def test_quality_bench_helpers():
    from pagedllm.bench.quality import _markdown_to_text, agreement, cut_slices

    md = "# Play\n\n## ACT I\n\n_Enter HAMLET_\n\n**HAMLET**  \nTo be, or not to be:  \nthat is it.\n"
    text = _markdown_to_text(md)
    assert "**" not in text and "#" not in text and "_Enter" not in text
    assert "Enter HAMLET" in text and "HAMLET\nTo be, or not to be:\nthat is it." in text
    texts = [list(range(100)), list(range(1000, 1050))]
    s = cut_slices(texts, 20, 5, skip=5)
    assert s[0] == list(range(5, 25)) and s[1] == list(range(1005, 1025))
    assert s[2] == list(range(25, 45)) and len(s) == 5 and all(len(x) == 20 for x in s)
    a = agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    assert a["identical_sequences"] == 1
    assert a["token_match_pct"] == pytest.approx(100 * 5 / 6)
    assert a["prefix_match_pct"] == pytest.approx(100 * 4 / 6)


@pytest.mark.parametrize("flag", ["--prompts", "--windows", "--new-tokens"])
def test_quality_bench_refuses_empty_counts(flag, capsys):
    """A count of 0 is refused at parsing, naming the flag (it raised an IndexError mid-run)."""
    from pagedllm.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "quality", flag, "0"])
    assert e.value.code == 2
    assert f"argument {flag}: must be at least 1, got 0" in capsys.readouterr().err


def test_quality_bench_takes_dequantize_weights(monkeypatch):
    """`bench quality --dequantize-weights` scores the cache types on the dequantized model: the
    flag reaches LLM(dequantize_weights=True) (issue 25 compares the caches' cost on both paths)."""
    import pagedllm
    from pagedllm.bench import quality
    from pagedllm.cli.main import main

    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(*args, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(pagedllm, "LLM", fake_llm)
    monkeypatch.setattr(quality, "_prepare_text", lambda a: ([[1, 2, 3]], [[1, 2]], 5, 1))
    with pytest.raises(Stop):
        main(["bench", "quality", "--cache-types", "int8", "--dequantize-weights", "--noise-dtype", ""])
    assert seen["dequantize_weights"] is True and seen["kv_cache_dtype"] == "int8"
