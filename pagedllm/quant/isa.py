"""The integer kernels' instruction sets on this CPU, and its int8 dot-product peak."""

from __future__ import annotations

import time

import torch

from ..native import cpu_kernels

# (4: the AVX2 kernels with AVX-VNNI's 256-bit vpdpbusd, held only by the avxvnni level's objects:
# VEX, or on a CPU with AVX-512 VNNI but no AVX-VNNI the EVEX twin, which the native level names)
ISA_NAMES = {1: "scalar", 2: "avx2", 3: "avx512-vnni", 4: "avxvnni"}
ISA_IDS = {v: k for k, v in ISA_NAMES.items()}


def available_isas() -> list[str]:
    ops = cpu_kernels()
    if ops is None:
        return []
    mask = int(ops.quant_isas())
    return [name for i, name in ISA_NAMES.items() if mask & (1 << (i - 1))]


def int8_peak_gmacs(seconds: float = 0.5, isa: str | None = None) -> float | None:
    """The CPU's int8 dot-product peak, in GMAC/s over torch's threads: the products the integer
    kernels issue (vpdpbusd with AVX-512 VNNI or AVX-VNNI, vpmaddubsw with AVX2) on independent register
    chains, nothing read from memory (csrc/quant_kernels.cpp). A decode step of many rows is
    bound by these, as batch 1 is by the read bandwidth. The best of three timed runs of about
    `seconds` / 3 each; None where no int8 SIMD path runs (scalar, or the kernels not built)."""
    ops = cpu_kernels()
    if ops is None:
        return None
    isa_id = ISA_IDS[isa] if isa else 0
    per_pass = int(ops.int8_peak_macs_per_pass(isa_id))
    if per_pass == 0:
        return None
    threads = torch.get_num_threads()

    def timed(iters: int) -> float:
        t0 = time.perf_counter()
        ops.int8_peak_run(isa_id, iters)
        return time.perf_counter() - t0

    iters = 1 << 14  # grown until a run is long enough to time, then sized to `seconds` / 3
    while (took := timed(iters)) < 0.02:
        iters *= 4
    iters = max(1, int(iters * seconds / 3 / took))
    return max(per_pass * iters * threads / timed(iters) for _ in range(3)) / 1e9
