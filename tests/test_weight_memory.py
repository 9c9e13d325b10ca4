"""Packed weights live in slabs marked for 2 MiB pages (native/csrc/weight_memory.cpp): the
same bytes as plain memory, in a mapping Linux may back with huge pages, handed back when the
weights go."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm.native import cpu_kernels
from pagedllm.quant import kernels as qk
from pagedllm.quant.formats import FORMATS, QuantTensor

from test_quant_kernels import random_blocks

ops = cpu_kernels()
# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        ops is None or not hasattr(ops, "weight_memory_stats"), reason="native kernels with weight slabs not built"
    ),
]
HUGE = 2 << 20


def pack(raw: np.ndarray, fmt: str, rows: int, cols: int) -> torch.Tensor:
    return QuantTensor(fmt, torch.from_numpy(raw), (rows, cols)).pack().data


def thp_mode() -> str | None:
    """The bracketed choice of /sys/kernel/mm/transparent_hugepage/enabled, None off Linux."""
    p = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not p.is_file():
        return None
    text = p.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def mapping_of(addr: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding `addr`: its range and fields."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            if entry is not None:
                break
            if lo <= addr < hi:
                entry = {"start": str(lo), "end": str(hi)}
        elif entry is not None and ":" in head:
            entry[head.rstrip(":")] = line.split(":", 1)[1].strip()
    assert entry is not None, f"no mapping holds {addr:#x}"
    return entry


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "Q6_K", "Q8_0"])
def test_slab_weights_hold_the_same_bytes_as_plain_memory(fmt, monkeypatch):
    rng = np.random.default_rng(7 + FORMATS[fmt][0])
    cols = 512
    raw = random_blocks(fmt, 48, cols, rng)
    slab = pack(raw, fmt, 48, cols)
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "0")
    plain = pack(raw, fmt, 48, cols)
    assert torch.equal(slab, plain)
    assert slab.data_ptr() % 64 == 0
    x = torch.from_numpy(rng.standard_normal((3, cols)).astype(np.float32))
    tid = FORMATS[fmt][0] + qk.PACKED_ID
    assert torch.equal(ops.quant_matmul(x, [slab], [tid], cols, 0), ops.quant_matmul(x, [plain], [tid], cols, 0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are asked of Linux only")
def test_slabs_are_2mib_aligned_mappings_marked_for_huge_pages(monkeypatch):
    rng = np.random.default_rng(3)
    w = pack(random_blocks("Q4_0", 64, 4096, rng), "Q4_0", 64, 4096)
    vma = mapping_of(w.data_ptr())
    assert int(vma["start"]) % HUGE == 0 and (int(vma["end"]) - int(vma["start"])) % HUGE == 0
    mode = thp_mode()
    if mode in ("always", "madvise") and "THPeligible" in vma:
        assert vma["THPeligible"] == "1", vma  # the kernel may give it 2 MiB pages
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "0")
    gc.collect()  # (earlier tests' weights freed now, not while this one packs)
    before = qk.weight_memory()
    plain = pack(random_blocks("Q4_0", 64, 4096, rng), "Q4_0", 64, 4096)
    # Off, the weight is at::empty's, not cut from a slab. (Whether Linux may give the
    # allocator's own memory huge pages is not ours to assert: per-size THP settings and
    # malloc tunables differ between machines, and a CI run saw THPeligible 1 there.)
    after = qk.weight_memory()
    assert after.huge_pages is False
    assert after.live <= before.live and after.mapped <= before.mapped  # (a freed weight may leave meanwhile)
    assert not int(vma["start"]) <= plain.data_ptr() < int(vma["end"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are asked of Linux only")
def test_slab_memory_is_handed_back_with_the_weights():
    rng = np.random.default_rng(5)
    gc.collect()
    before = qk.weight_memory()
    assert before.huge_pages
    small = pack(random_blocks("Q4_0", 32, 1024, rng), "Q4_0", 32, 1024)
    # Over half a slab (64 MiB): a mapping of its own, unmapped with the weight.
    rows, cols = 1024, 65536
    big = pack(random_blocks("Q8_0", rows, cols, rng), "Q8_0", rows, cols)
    during = qk.weight_memory()
    assert during.live == before.live + small.numel() + big.numel()
    assert during.slabs >= before.slabs + 1
    assert during.mapped >= before.mapped + big.numel()
    del big
    gc.collect()
    after = qk.weight_memory()
    assert after.live == before.live + small.numel()
    assert after.slabs == during.slabs - 1 and after.mapped <= during.mapped - 64 * 2**20
    small[0, 0] = 1  # still its own memory
    del small
    gc.collect()
    assert qk.weight_memory().live == before.live


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are asked of Linux only")
def test_a_dense_models_large_weights_load_into_the_slabs(tmp_path, hf_smollm2_tokenizer, monkeypatch):
    """A safetensors model's weights of 1 MiB or more (here the embedding, tied to the head) are
    placed in the slabs when the model is materialised, small ones (norms) in plain memory, and
    the model gives the tokens it gives with PAGEDLLM_HUGE_PAGES=0."""
    from pagedllm import LLM, SamplingParams

    from models import build_checkpoint

    tok = hf_smollm2_tokenizer
    path = build_checkpoint("llama", tmp_path / "llama", tok, len(tok))
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [list(range(100, 130)), list(range(400, 405))]
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=8)
    model = getattr(llm.engine.model, "model", llm.engine.model)
    embed = model.embed_tokens.weight
    assert embed.numel() * 4 >= qk.DENSE_SLAB_BYTES
    vma = mapping_of(embed.data_ptr())
    assert int(vma["start"]) % HUGE == 0, vma
    if thp_mode() in ("always", "madvise"):  # (with "never" no mapping is eligible)
        assert vma.get("THPeligible", "1") == "1", vma
    norm = model.norm.weight
    assert norm.numel() * 4 < qk.DENSE_SLAB_BYTES
    assert mapping_of(norm.data_ptr()) != vma
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    del llm, model, embed, norm
    gc.collect()
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "0")
    plain = LLM(str(path), dtype="float32", kv_cache_memory_mb=8)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, sp)] == got


def llc_bytes() -> int:
    """The last-level cache's size as Linux says it, 0 where it does not."""
    p = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    text = p.read_text().strip() if p.is_file() else ""
    if not text:
        return 0
    scale = {"K": 2**10, "M": 2**20}.get(text[-1], 1)
    return int(text.rstrip("KM")) * scale


def amd_cpu() -> bool:
    p = Path("/proc/cpuinfo")
    return p.is_file() and "AuthenticAMD" in p.read_text()


@pytest.mark.parametrize("slabs", ["1", "0"])
def test_the_prefetch_distance_follows_the_weights_alive(slabs, monkeypatch):
    """The packed kernels prefetch 2 KiB ahead while the weights alive, slabs or plain memory,
    exceed half the last-level cache (a step reads them from DRAM), 8 KiB while they fit; on
    AMD's CPUs, whose hardware prefetcher needs no help beyond the next lines, 256 bytes."""
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", slabs)
    gc.collect()
    before = qk.weight_memory()
    llc = llc_bytes()
    if amd_cpu():
        assert before.prefetch == 256
    elif llc:
        assert before.prefetch == (8192 if before.weights <= llc // 2 else 2048), (before, llc)
    n = max(4 << 30, llc)  # (mapped, never touched)
    big = ops.weight_buffer(n)
    during = qk.weight_memory()
    assert during.weights == before.weights + n
    assert during.prefetch == (256 if amd_cpu() else 2048)
    del big
    gc.collect()
    after = qk.weight_memory()
    assert (after.weights, after.prefetch) == (before.weights, before.prefetch)


def test_a_fixed_prefetch_distance_holds(tune):
    """The tuning knob prefetch_bytes fixes the distance, whatever the weights; unset, it follows
    them again."""
    tune(prefetch_bytes=1000)
    m0 = qk.weight_memory()
    w = ops.weight_buffer(4 << 30)
    assert (m0.prefetch, qk.weight_memory().prefetch) == (1000, 1000)
    tune(prefetch_bytes=None)
    assert qk.weight_memory().prefetch != 1000
    del w
