"""A pipeline stage's paged KV cache: slots for its own layers only, read with rank 0's block
tables (the whole model's KV groups), and the cache settings a pipeline refuses."""

from __future__ import annotations

import torch


def stage_slots(groups, stage) -> tuple[dict[int, int], int]:
    """(each of the stage's layers' slot in a page, slots per page) for `stage` of a model with
    these KV groups: the stage's layers of each group, in slot order."""
    slot_of = {}
    for layers in groups.layers:
        for j, layer in enumerate(x for x in layers if stage.holds(x)):
            slot_of[layer] = j
    return slot_of, max(slot_of.values()) + 1


def stage_kv(cfg, stage, kv_heads: int, cache_cfg, num_blocks: int, device: torch.device, dtype: torch.dtype):
    """(paged cache, attention backend, prefix-copy function) for `stage`'s layers, read with
    rank 0's block tables (the whole model's KV groups). `cfg`: the ModelConfig."""
    from ..attention.paged import PagedAttentionBackend
    from ..kv.cache import KVCacheSpec, PagedKVCache
    from ..kv.groups import plan_groups

    check_cache(cache_cfg)
    groups = plan_groups(cfg.layer_windows, cfg.num_layers, hybrid=True)
    group_of = groups.layer_group
    slot_of, slots = stage_slots(groups, stage)
    spec = KVCacheSpec(slots, kv_heads, cfg.head_dim, cache_cfg.block_size, dtype, cache_cfg.kv_cache_dtype)
    cache = PagedKVCache(spec, num_blocks, device, None, [slot_of[i] for i in stage.layers])
    backend = PagedAttentionBackend(cache, [group_of[i] for i in stage.layers], groups.num_groups)
    return cache, backend, cache.copy_block_prefix


def check_cache(cache_cfg) -> None:
    """Refuse, before anything starts, the cache settings a pipeline does not run."""
    from ..kv.quant import get_mode

    if not cache_cfg.paged_attention:
        raise ValueError(
            "pipeline parallelism runs on the paged KV cache; drop paged_attention=False "
            "(--no-paged-attn) or use pipeline_parallel_size=1"
        )
    if get_mode(cache_cfg.kv_cache_dtype).head_scales:
        raise ValueError(
            f"kv_cache_dtype={cache_cfg.kv_cache_dtype!r} calibrates its scales over the whole model; "
            "pipeline parallelism does not run it yet (use auto or int8, or pipeline_parallel_size=1)"
        )
