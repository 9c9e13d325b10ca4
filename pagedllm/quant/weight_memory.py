"""Where packed and large dense weights live: the native library's 2 MiB-aligned slabs
(native/csrc/weight_memory.cpp)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..native import cpu_kernels


@dataclass
class WeightMemory:
    """Where the packed weights live (native/csrc/weight_memory.cpp): `live` bytes handed out
    from `slabs` slabs of 2 MiB-aligned memory marked for transparent huge pages, `mapped`
    bytes mapped for them; `huge_pages` False where PAGEDLLM_HUGE_PAGES=0 or off Linux;
    `weights` bytes of all such weights alive, slabs or not, and `prefetch` how many bytes ahead
    the packed kernels prefetch them (2 KiB while they exceed half the last-level cache, else
    8 KiB; 256 B on AMD's CPUs; tuning prefetch_bytes fixes it)."""

    live: int
    mapped: int
    slabs: int
    huge_pages: bool
    weights: int | None = None
    prefetch: int | None = None


def weight_memory() -> WeightMemory | None:
    """The packed weights' slabs now; None without the native kernels."""
    ops = cpu_kernels()
    if ops is None:
        return None
    live, mapped, slabs, on, *rest = ops.weight_memory_stats()
    return WeightMemory(live, mapped, slabs, bool(on), *rest)


# Dense weights from this size up go to the huge-page slabs too (smaller ones, norms and
# biases, are not streamed enough to matter).
DENSE_SLAB_BYTES = 1 << 20


def weight_buffer(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised CPU tensor from the weight slabs (2 MiB pages where Linux grants them;
    native/csrc/weight_memory.cpp), for a dense weight of DENSE_SLAB_BYTES or more; None where
    it is smaller, the slabs are off (PAGEDLLM_HUGE_PAGES=0) or the native kernels are. Dense
    weights gain from 2 MiB pages as packed ones do (docs/benchmarks/from-code.md, "Dense weights
    in 2 MiB pages")."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < DENSE_SLAB_BYTES:
        return None
    ops = cpu_kernels()
    if ops is None or not ops.weight_memory_stats()[3]:
        return None
    return ops.weight_buffer(nbytes).view(dtype).view(shape)
