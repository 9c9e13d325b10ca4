"""The KV-cache trace: what the cache is (layout, dtype, capacity) and what it does
(occupancy, prefix-cache hits, preemptions, waste), as one dataclass."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .cache import dtype_name


@dataclass
class KVCacheTrace:
    dtype: str  # effective storage dtype, never "auto"
    compute_dtype: str
    quant_mode: str
    scale_granularity: str
    scale_source: str
    decode_attention: str  # the path decode really uses, and why
    block_size: int
    physical_page_key: str
    prefix_cache: bool  # effective
    prefix_cache_note: str
    paged_attention: bool  # effective
    paged_attention_min_context: int
    entry_count: int  # layers with a cache
    cached_tokens: int  # tokens held in blocks the prefix cache can hand out again
    resident_token_slots: int  # token slots of blocks that are in use or cached
    capacity_blocks: int
    capacity_tokens: int
    memory_mb: float  # the ceiling: what the pools may grow to
    committed_mb: float  # what they hold now (estimated: see `committed_bytes`)
    committed_how: str
    sized_by: str
    blocks_used: int  # every model's: a draft model's blocks come from the same pool
    # KV groups (kv/groups.py): how layers share block tables, and the blocks each group's
    # live tables hold now (a block is a page of `kv_group_layers` layers).
    kv_groups: str
    kv_group_layers: int
    blocks_used_by_group: list[int]
    blocks_free: int
    blocks_cached: int
    blocks_touched: int  # distinct blocks ever handed out (the working set, with LIFO reuse)
    blocks_peak_used: int  # most blocks live sequences held at once
    max_seqs_at_max_model_len: int
    max_model_len: int
    prefix_cache_hit_rate: float
    prefix_tokens_saved: int
    prefix_partial_tokens_saved: int
    evictions: int
    preemptions: int
    waste: float  # share of allocated token slots (live sequences) not holding a token, now
    waste_avg: float  # the same averaged over every engine step so far
    # The weights beside the cache: each format held, resident MB, and the kernel path (or why not).
    weight_formats: str = ""
    weight_kernel: str = ""
    # Tensor parallelism: ranks, each rank's resident weight MB and KV-cache MB (the pools'
    # ceiling), and the bytes rank 0 all-reduced and gathered per forward pass, on average.
    tensor_parallel_size: int = 1
    rank_weight_mb: list = field(default_factory=list)
    rank_kv_mb: list = field(default_factory=list)
    allreduce_bytes_per_step: float = 0.0
    # Pipeline parallelism: stages, each stage's layers (each rank's weight and KV MB are in
    # rank_weight_mb / rank_kv_mb, stage by stage, a stage's TP ranks together; their sum is the
    # pipeline's), and the bytes rank 0 sent and received stage to stage per step, on average.
    pipeline_parallel_size: int = 1
    stage_layers: list = field(default_factory=list)
    p2p_bytes_per_step: float = 0.0
    # Speculative decoding: the method ("off" without), its draft tokens verified and accepted.
    speculative: str = "off"
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0  # draft tokens accepted per verification
    # Method "draft": the draft model's KV groups in the same block pool (one budget; its pages
    # in a cache of its own under the same block ids): the pool's blocks, those the draft's
    # tables hold now (counted in blocks_used too), its pages' ceiling and what they hold now.
    spec_draft_cache: str = ""
    spec_draft_blocks_total: int = 0
    spec_draft_blocks_used: int = 0
    spec_draft_memory_mb: float = 0.0
    spec_draft_committed_mb: float = 0.0
    # Mixtures of experts: how the experts run, and the rows routed to each expert in the
    # last step (summed over the sparse layers: each of a step's rows counts k times a layer).
    moe_experts: str = ""
    moe_last_step_rows_per_expert: list = field(default_factory=list)
    # LoRA (pagedllm/lora): adapter slots, the adapters in them and their weights' memory.
    lora_slots: int = 0
    lora_adapters: list = field(default_factory=list)
    lora_memory_mb: float = 0.0
    lora_loads: int = 0  # adapters read from disk (LRU reloads included)

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        d = self.to_dict()
        w = max(map(len, d))
        return "\n".join(f"{k:<{w}}  {_fmt(v)}" for k, v in d.items())


def _fmt(v) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(map(_fmt, v)) + "]"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def live_waste(seqs, block_size: int) -> tuple[int, int]:
    """(allocated slots, slots holding a token) over live sequences, shared blocks once."""
    filled: dict[int, int] = {}
    for s in seqs:
        n = s.num_computed_tokens  # tokens with K/V in a slot (a chunked prompt: so far)
        for table in (s.block_table, *s.group_tables):
            for i, bid in enumerate(table):
                if bid:
                    filled[bid] = max(filled.get(bid, 0), min(block_size, max(0, n - i * block_size)))
    return len(filled) * block_size, sum(filled.values())


def committed_bytes(engine) -> tuple[int, str]:
    """(bytes the KV cache holds in memory now, how that was found).

    Lazily allocated CPU pools: estimated as the blocks ever handed out (the free list is a
    stack, so these are blocks 1..num_touched) plus the null block, whole blocks, in every
    layer. Pages are 4 KiB and a block's slice of one layer is a few of them, so the estimate
    is within a page per (layer, K/V) pool of what the OS really holds."""
    cache = engine.kv_cache
    if cache is None:  # contiguous: per-sequence buffers, allocated as sequences grow
        return engine.backend.nbytes_held, "buffers held by live sequences"
    if not cache.lazy:
        return cache.nbytes, f"zero-filled at start on {cache.data.device.type}"
    touched = engine.block_manager.num_touched
    return cache.committed_bytes(touched), f"estimated: {touched} blocks ever written + the null block"


def build_trace(engine) -> KVCacheTrace:
    return KVCacheTrace(
        **_layout(engine),
        **_occupancy(engine),
        weight_formats=_weight_formats(engine),
        weight_kernel=_weight_kernel(engine),
        **_tp_fields(engine),
        **_speculative(engine),
        **_moe(engine),
        **_lora(engine),
    )


def _layout(engine) -> dict:
    """What the cache is: its element types, pages, size and how it was sized."""
    spec, plan, bs = engine.kv_spec, engine.cache_plan, engine.block_manager.block_size
    info = plan.info(spec)
    paged = engine.cache_config.paged_attention
    committed, how = committed_bytes(engine)
    groups = engine.kv_groups
    page_key = (
        "(layer, block id): each layer's K and V pools hold a page of "
        f"[{bs} tokens, {spec.num_kv_heads} kv heads, {spec.head_dim}] per block id; "
        "a block's reusable content is keyed by the chained hash of (parent block hash, its token ids)"
        + (
            ""
            if groups.num_groups == 1
            else f"; KV groups: a block belongs to one group's tables and holds "
            f"{groups.slots} layer slots, its hash keys the group too"
        )
    )
    return dict(
        dtype=info.get("dtype", dtype_name(spec.dtype)),
        compute_dtype=info.get("compute_dtype", dtype_name(engine.dtype)),
        quant_mode=info.get("quant_mode", "none"),
        scale_granularity=info.get("scale_granularity", "none"),
        scale_source=info.get("scale_source", "none"),
        decode_attention=engine.backend.describe_decode(),
        block_size=bs,
        physical_page_key=page_key
        if paged
        else "(sequence id, layer): one contiguous growing K and V buffer per sequence",
        prefix_cache=engine.prefix_caching,
        prefix_cache_note=engine.prefix_caching_note,
        paged_attention=paged,
        paged_attention_min_context=0 if paged else -1,
        entry_count=engine.model_config.num_layers,
        memory_mb=info.get("memory_mb", plan.num_blocks * spec.bytes_per_block / 2**20),
        committed_mb=committed / 2**20,
        committed_how=how,
        sized_by=plan.source,
        kv_groups=groups.describe(),
        kv_group_layers=groups.slots,
    )


def _occupancy(engine) -> dict:
    """What the cache holds now and has done: blocks, cached prefixes, evictions, waste."""
    bm, bs = engine.block_manager, engine.block_manager.block_size
    alloc, held = live_waste(engine.scheduler.running, bs)
    stats = bm.stats
    cached_blocks = [b for b in bm.blocks[1:] if b.hash is not None or b.tokens]
    max_len = engine.sched_config.max_model_len
    steps = max(1, engine.waste_steps)
    return dict(
        cached_tokens=sum(bs if b.hash is not None else len(b.tokens) for b in cached_blocks),
        resident_token_slots=(bm.num_used_blocks + len(bm.evictable)) * bs,
        capacity_blocks=bm.num_usable_blocks,
        capacity_tokens=bm.num_usable_blocks * bs,
        blocks_used=bm.num_used_blocks,
        blocks_used_by_group=_blocks_by_group(engine),
        blocks_free=len(bm.free_ids),
        blocks_cached=len(cached_blocks),
        blocks_touched=bm.num_touched,
        blocks_peak_used=bm.peak_used,
        max_seqs_at_max_model_len=bm.num_usable_blocks // -(-max_len // bs),
        max_model_len=max_len,
        prefix_cache_hit_rate=stats.hit_rate,
        prefix_tokens_saved=stats.hits,
        prefix_partial_tokens_saved=stats.partial_hits,
        evictions=stats.evictions,
        preemptions=engine.scheduler.num_preemptions,
        waste=(1 - held / alloc) if alloc else 0.0,
        waste_avg=engine.waste_sum / steps if engine.waste_steps else 0.0,
    )


def _lora(engine) -> dict:
    mgr = engine.lora  # (kv/ reads the engine's parts by name: it imports none of their packages)
    if mgr is None:
        return {}
    return dict(
        lora_slots=mgr.max_loras,
        lora_adapters=[r.lora_name for r in mgr.loaded.values()],
        lora_memory_mb=mgr.memory_bytes / 2**20,
        lora_loads=mgr.num_loads,
    )


def _tp_fields(engine) -> dict:
    ex = engine.executor
    if ex is None:
        w = engine.weights.resident_bytes if engine.weights else 0
        kv = engine.kv_cache.nbytes if engine.kv_cache is not None else 0
        return dict(rank_weight_mb=[w / 2**20], rank_kv_mb=[kv / 2**20])
    return ex.trace_fields()


def _speculative(engine) -> dict:
    spec = engine.spec
    if spec is None:
        return {}
    st = spec.stats
    c = spec.config
    draft = spec.draft
    how = (
        f"ngram (suffix {c.min_ngram}..{c.max_ngram} tokens)"
        if c.method == "ngram"
        else f"draft model {draft.name if draft is not None else c.model} (greedy proposals)"
    )
    if c.ngram:
        how += f" and ngram lookup ({st.ngram_proposed} of the proposals)"
    lengths = f"adaptive lengths (measured costs; {st.declined} declines)" if c.adaptive else "fixed lengths"
    out = dict(
        speculative=f"{how}, up to {c.num_tokens} tokens a step, {lengths}; off above {c.max_batch} "
        f"decoding sequences; {st.paused} pauses for low acceptance",
        spec_proposed_tokens=st.proposed,
        spec_accepted_tokens=st.accepted,
        spec_acceptance_rate=st.acceptance_rate,
        spec_mean_accepted_length=st.mean_accepted_length,
    )
    if draft is not None:
        dbm = draft.block_manager
        out.update(
            spec_draft_cache=draft.describe(),
            spec_draft_blocks_total=dbm.num_usable_blocks,
            spec_draft_blocks_used=dbm.num_held_blocks,
            spec_draft_memory_mb=draft.memory_mb,
            spec_draft_committed_mb=draft.committed_mb,
        )
    return out


def _moe(engine) -> dict:
    paths = engine.model.expert_paths()
    if not paths:
        return {}
    counts = [sum(c) for c in zip(*(m.last_counts for _, m in paths if m.last_counts))]
    return dict(moe_experts=f"{len(paths)} sparse layers; {paths[0][1].path()}", moe_last_step_rows_per_expert=counts)


def _blocks_by_group(engine) -> list[int]:
    """Distinct blocks the live sequences' tables of each KV group hold."""
    bm = engine.block_manager
    held: list[set[int]] = [set() for _ in range(bm.num_groups)]
    for s in engine.scheduler.running:
        for g, table in enumerate(bm.tables(s)):
            held[g].update(b for b in table if b)
    return [len(h) for h in held]


def _weight_formats(engine) -> str:
    w = engine.weights
    if w is None:
        return ""
    fmts = ", ".join(f"{n} x{c}" for n, c in sorted(w.formats.items(), key=lambda kv: -kv[1]))
    return f"{fmts} ({w.resident_bytes / 2**20:.1f} MB resident{_huge_pages()})"


def _huge_pages() -> str:
    """Where the packed weights sit: huge-page slabs (and how much of the process the kernel
    backs with 2 MiB pages), or nothing where they are plain pages."""
    from ..quant.kernels import weight_memory

    m = weight_memory()
    if m is None or not m.huge_pages or not m.live:
        return ""
    huge = 0
    try:
        with open("/proc/self/smaps_rollup") as fh:
            huge = next((int(line.split()[1]) for line in fh if line.startswith("AnonHugePages:")), 0)
    except OSError:
        pass
    ahead = f", prefetched {m.prefetch / 1024:g} KiB ahead" if m.prefetch is not None else ""
    return (
        f"; packed weights {m.live / 2**20:.1f} MB in slabs marked for 2 MiB pages{ahead}, "
        f"the process holds {huge / 1024:.1f} MB in such pages"
    )


def _weight_kernel(engine) -> str:
    w = engine.weights
    if w is None:
        return ""
    if w.kernel:
        from ..quant.kernels import (
            X2_ROWS,
            X2_WIDTH,
            activation_mode,
            amx_rows,
            int_rows,
            narrow_steps_x2,
            wide_mode,
            wide_steps_int,
            wide_x2_roles,
        )

        mode = activation_mode()
        wide = wide_x2_roles()
        hidden = engine.model_config.hidden_size
        except_wide = f" except {', '.join(wide)}" if wide else ""
        if mode != "auto":
            acts = f"activations {mode}"
        elif narrow_steps_x2(hidden):
            acts = f"activations int8x2 up to {X2_ROWS} rows, int8 above{except_wide}"
        else:
            acts = f"activations int8{except_wide} at every width, the model {hidden} >= {X2_WIDTH} wide"
        amx = amx_rows()
        if amx and dtype_name(engine.dtype) == "bfloat16":
            acts += f"; steps of {amx}+ rows on packed weights: AMX bf16 tile products"
        if wide_steps_int(hidden):
            why = "tuning quant_wide=int" if wide_mode() == "int" else f"the model {hidden} wide, no AMX"
            prefill = f"and past {int_rows()} rows too (prefill), the head aside ({why})"
        else:
            prefill = "tile dequantize + GEMM for long prefills"
        return f"quantized {w.kernel} integer kernels at decode ({acts}), {prefill} ({w.reason})"
    return f"float GEMMs on dequantized weights ({w.reason})"
