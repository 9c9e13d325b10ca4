"""What a model's KV cache is and how many blocks it gets: the cache spec of this rank's KV
heads, the pool's size plan (the target's groups and a draft model's beside them), and whether
prefix caching really runs. The cache and the backend that reads it are built by
attention/build.py (the backends are a layer above this package)."""

from __future__ import annotations

import torch

from ..config import CacheConfig, SchedulerConfig
from .cache import CachePlan, KVCacheSpec, plan_cache
from .groups import KVGroups, blocks_held, plan_groups


def kv_groups_of(model_config, cache_cfg: CacheConfig) -> KVGroups:
    """Layers that attend alike share a block table; sliding and global layers do not (under
    paged attention)."""
    return plan_groups(model_config.layer_windows, model_config.num_layers, hybrid=cache_cfg.paged_attention)


def kv_spec_of(loaded, cache_cfg: CacheConfig, dtype: torch.dtype, groups: KVGroups | None = None) -> KVCacheSpec:
    """The cache of this rank's KV heads (all of them without tensor parallelism), one slot per
    layer of a KV group. `loaded`: a LoadedModel (pagedllm/loading)."""
    cfg = loaded.config
    groups = groups or kv_groups_of(cfg, cache_cfg)
    return KVCacheSpec(
        groups.slots, loaded.model.shard.kv_heads, cfg.head_dim, cache_cfg.block_size, dtype, cache_cfg.kv_cache_dtype
    )


def plan_pool(
    spec: KVCacheSpec,
    cache_cfg: CacheConfig,
    sched_cfg: SchedulerConfig,
    device: torch.device,
    windows: list[int | None],
    draft: KVCacheSpec | None = None,
) -> CachePlan:
    """The block pool's size: `windows`, every KV group's (the target's, and a draft model's
    beside them when `draft`, its spec, is given: one pool for both)."""
    return plan_cache(
        spec,
        cache_cfg,
        device,
        sched_cfg.max_model_len,
        sched_cfg.max_num_seqs,
        lambda n: blocks_held(windows, n, cache_cfg.block_size, sched_cfg.max_num_batched_tokens),
        len(windows),
        also=draft,
    )


def prefix_caching_mode(cache_cfg: CacheConfig, model_config) -> tuple[bool, str]:
    """Whether prefix caching is really on, and why not when it was asked for."""
    if not cache_cfg.enable_prefix_caching:
        return False, "disabled by the user"
    if cache_cfg.prefix_cache_n == 0:
        return False, "disabled by the user (prefix_cache_n=0)"
    if not cache_cfg.paged_attention:
        return False, "needs paged attention (a contiguous per-sequence cache cannot share blocks)"
    note = f"on: chained block hashes, up to {cache_cfg.prefix_cache_n} finished sequences kept"
    if model_config.all_layers_sliding:
        note += (
            "; blocks behind the sliding window are released into the LRU, and a prefix is "
            "reused where the window before its end is still cached"
        )
    return True, note
