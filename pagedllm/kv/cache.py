"""The physical KV cache: one pool of fixed-size blocks per layer, and its sizing."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from ..config import CacheConfig, cdiv

logger = logging.getLogger(__name__)

# Share of the memory left after the weights that the cache takes when no size is given.
DEFAULT_FRACTION = {"cuda": 0.9, "mps": 0.5, "cpu": 0.15}


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


@dataclass
class CachePlan:
    num_blocks: int
    source: str  # which setting decided the size, for the log and the trace

    def describe(self, spec: KVCacheSpec) -> str:
        mb = self.num_blocks * spec.bytes_per_block / 2**20
        return (f"KV cache: {mb:.1f} MB, {self.num_blocks} blocks of {spec.block_size} tokens "
                f"= {self.num_blocks * spec.block_size} token slots ({self.source})")


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "mps":
        return int(psutil.virtual_memory().available)  # unified memory
    return int(psutil.virtual_memory().available)


def plan_cache(spec: KVCacheSpec, cfg: CacheConfig, device: torch.device,
               max_model_len: int, max_num_seqs: int) -> CachePlan:
    """Turn exactly one of the three size settings (or the default) into a block count."""
    bpb = spec.bytes_per_block
    if cfg.kv_cache_memory_mb is not None:
        n = int(cfg.kv_cache_memory_mb * 2**20 // bpb)
        plan = CachePlan(n, f"kv_cache_memory_mb={cfg.kv_cache_memory_mb:g}")
    elif cfg.kv_cache_context_len is not None:
        n = cdiv(cfg.kv_cache_context_len, spec.block_size)
        plan = CachePlan(n, f"kv_cache_context_len={cfg.kv_cache_context_len}")
    else:
        avail = available_memory_bytes(device)
        if cfg.kv_cache_memory_fraction is not None:
            frac = cfg.kv_cache_memory_fraction
            plan = CachePlan(int(avail * frac // bpb),
                             f"kv_cache_memory_fraction={frac:g} of {avail / 2**20:.0f} MB free")
        else:
            frac = DEFAULT_FRACTION.get(device.type, 0.15)
            n = int(avail * frac // bpb)
            # No point reserving more than every sequence at full length could use.
            cap = cdiv(max_model_len, spec.block_size) * max_num_seqs
            plan = CachePlan(min(n, cap), f"default: {frac:g} of {avail / 2**20:.0f} MB free, "
                             f"capped at max_num_seqs x max_model_len")
    plan.num_blocks += 1  # the null block
    if plan.num_blocks < 2:
        raise ValueError(
            f"the KV cache budget ({plan.source}) holds no block of {spec.block_size} tokens "
            f"({bpb / 2**20:.3f} MB each); give it more memory")
    return plan


class PagedKVCache:
    """K and V pools, [num_layers][num_blocks, block_size, num_kv_heads, head_dim] each.

    Zero-filled so never-written slots read as finite numbers (masked out, but
    0 * NaN would still poison the attention output).
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.data = torch.zeros(shape, dtype=spec.dtype, device=device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, 0], self.data[i, 1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    # -- copies for prefix caching and copy-on-write ------------------------
    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer (K and V)."""
        self.data[:, :, dst] = self.data[:, :, src]

    def copy_block_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy the first n token slots of block src into block dst in every layer."""
        self.data[:, :, dst, :n] = self.data[:, :, src, :n]
