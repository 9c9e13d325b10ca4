"""A model's KV cache and the attention backend that reads it, built from the cache spec
(kv/spec.py): the paged cache and its backend, or the contiguous per-sequence backend."""

from __future__ import annotations

import torch

from ..config import CacheConfig
from ..kv.cache import KVCacheSpec, PagedKVCache
from ..kv.groups import KVGroups
from ..kv.spec import kv_groups_of
from .calibration import resolve_fp8_scales
from .contiguous import ContiguousBackend
from .paged import PagedAttentionBackend


def _no_copy(src: int, dst: int, n: int) -> None:
    pass


def build_kv(
    loaded,
    spec: KVCacheSpec,
    cache_cfg: CacheConfig,
    num_blocks: int,
    device: torch.device,
    dtype: torch.dtype,
    groups: KVGroups | None = None,
):
    """(paged cache or None, attention backend, the block manager's copy function). An f8e4m3
    cache first gets its fixed per-(layer, KV head) scales (from the checkpoint, else calibrated:
    under tensor parallelism every rank calibrates its own heads in the same forward).
    `loaded`: a LoadedModel (pagedllm/loading)."""
    cfg = loaded.config
    groups = groups or kv_groups_of(cfg, cache_cfg)
    head_scales = None
    if spec.mode.head_scales:
        head_scales, spec.scale_source = resolve_fp8_scales(
            loaded.model, loaded.tokenizer, loaded.kv_scales, cfg.num_layers, cfg.num_kv_heads, device
        )
    if cache_cfg.paged_attention:
        slot, group = groups.layer_slot, groups.layer_group
        kv_cache = PagedKVCache(spec, num_blocks, device, head_scales, [slot[i] for i in range(cfg.num_layers)])
        return (
            kv_cache,
            PagedAttentionBackend(kv_cache, [group[i] for i in range(cfg.num_layers)]),
            kv_cache.copy_block_prefix,
        )
    # Each sequence's K/V is private: nothing to copy; forks copy in the backend.
    return None, ContiguousBackend(dtype, device, spec.mode, head_scales), _no_copy
