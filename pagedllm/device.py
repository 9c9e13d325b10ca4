"""Choosing the device and the compute dtype."""

from __future__ import annotations

import logging
from functools import lru_cache

import torch

from . import settings

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "f32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "f16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but this torch build sees no CUDA GPU")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' was asked for but MPS is not available here")
    return dev


@lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls are only faster than fp32 on CPUs with native bf16 dot products."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        try:
            return DTYPES[dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16") from None
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


@lru_cache(maxsize=None)
def _glibc(name: str, argtypes: tuple, restype):
    """glibc's function `name`, or None where the C library is not glibc (macOS, musl)."""
    import ctypes
    import ctypes.util

    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


def _libc_malloc_trim():
    import ctypes

    return _glibc("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS. Loading frees much more than it keeps (file
    metadata, vocabulary lists, staging copies); glibc keeps those pages mapped, and they stay
    in the resident set until the heap reuses them, which a serving process may never do."""
    fn = _libc_malloc_trim()
    if fn is not None:
        fn(0)


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KEEP_BUFFERS_BYTES = 1 << 30


def keep_freed_buffers() -> bool:
    """Let the heap keep what a step frees for the next step to reuse. glibc serves blocks over
    its mmap threshold (at most 32 MB by its own rule) with fresh mappings and unmaps them when
    freed, so a 512-token prefill of a 1.5B model asked the kernel for new zeroed pages for
    its large activations in every layer of every prefill, each page's first touch a fault
    (docs/benchmarks/quantized-kernels.md, "The heap keeps what a step frees"). Set after loading, whose
    freed memory `release_freed_memory` hands back first; `PAGEDLLM_KEEP_BUFFERS=0` leaves
    glibc's defaults. False where it was not set (another C library, or turned off)."""
    if not settings.get("keep_buffers"):
        return False
    fn = _libc_mallopt()
    if fn is None:
        return False
    return fn(_M_MMAP_THRESHOLD, KEEP_BUFFERS_BYTES) == 1 and fn(_M_TRIM_THRESHOLD, KEEP_BUFFERS_BYTES) == 1


def _libc_mallopt():
    import ctypes

    return _glibc("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
