"""The engine assembled from the config: every part built whole, its collaborators passed to
its constructor, in the order they need one another."""

from __future__ import annotations

import logging

import torch

from ..attention.build import build_kv
from ..config import CacheConfig, SchedulerConfig
from ..kv.groups import plan_groups
from ..kv.spec import kv_spec_of, plan_pool, prefix_caching_mode
from ..loading.loader import LoadedModel
from ..lora.manager import LoRAManager
from ..multimodal import EncoderCache
from ..sampling.sampler import Sampler
from ..speculative.config import SpeculativeConfig
from ..speculative.decoder import SpeculativeDecoder
from ..structured.grammar import GrammarEngine
from .block_manager import BlockManager
from .draft import DraftModel, check_draft_setup, draft_cache_config, draft_kv_groups, shared_pool_note
from .llm_engine import KVParts, LLMEngine
from .model_runner import ModelRunner
from .output_processor import OutputProcessor
from .scheduler import Scheduler

logger = logging.getLogger(__name__)


def build_engine(
    loaded: LoadedModel,
    cache_cfg: CacheConfig,
    sched_cfg: SchedulerConfig,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    executor=None,
    speculative: SpeculativeConfig | None = None,
    draft: LoadedModel | None = None,
    max_lora_rank: int = 16,
    runner_cls=ModelRunner,
) -> LLMEngine:
    """`executor`: rank 0's side of tensor or pipeline parallelism (distributed/executor.py), or
    None. `draft`: the loaded draft model of speculative method "draft" (its KV groups draw from
    this engine's block pool). LoRA adapters: `sched_cfg.max_loras` > 0 slots of rank up to
    `max_lora_rank`. `runner_cls`: the ModelRunner, or a subclass that runs the step another way."""
    cache_cfg.validate()
    sched_cfg.validate()
    check_draft_setup(speculative, draft)
    cfg, model = loaded.config, loaded.model
    groups, kv_spec, draft_spec, plan, kv_cache, backend, copy_fn = _build_kv(
        loaded, cache_cfg, sched_cfg, device, dtype, executor, draft
    )
    block_manager, prefix_caching, note = _block_manager(cache_cfg, cfg, plan.num_blocks, copy_fn, groups)
    lora = LoRAManager(model, sched_cfg.max_loras, max_lora_rank, dtype, device) if sched_cfg.max_loras else None
    # Vision-language models: image embeddings cached by content hash, encoded in the step
    # within an encoder budget (pagedllm/multimodal).
    encoder_cache = (
        EncoderCache(max(sched_cfg.encoder_cache_tokens, sched_cfg.encoder_budget)) if model.vision else None
    )
    output = OutputProcessor(loaded.tokenizer, set(cfg.eos_token_ids) | set(loaded.tokenizer.eos_token_ids))
    structured = GrammarEngine(loaded.tokenizer, cfg.vocab_size, sorted(output.eos_token_ids))
    sampler = Sampler(device, seed)
    runner = runner_cls(model, backend, cache_cfg.block_size, device, sampler, structured, lora, encoder_cache)
    spec = _speculative_decoder(speculative, draft, draft_spec, cache_cfg, sched_cfg, block_manager, device, dtype)
    # A preempted sequence's draft blocks go back to the pool at once, so the scheduler's room
    # check sees them before it preempts another.
    scheduler = Scheduler(sched_cfg, block_manager, encoder_cache, on_preempt=spec.release if spec else None)
    kv = KVParts(groups, kv_spec, plan, kv_cache, backend, prefix_caching, note)
    return LLMEngine(
        loaded,
        cache_cfg,
        sched_cfg,
        device,
        dtype,
        kv=kv,
        block_manager=block_manager,
        scheduler=scheduler,
        runner=runner,
        output=output,
        structured=structured,
        lora=lora,
        encoder_cache=encoder_cache,
        spec=spec,
        executor=executor,
    )


def _block_manager(cache_cfg: CacheConfig, cfg, num_blocks: int, copy_fn, groups) -> tuple[BlockManager, bool, str]:
    """The block manager, with prefix caching where it can run here (and why not, where not)."""
    prefix_caching, note = prefix_caching_mode(cache_cfg, cfg)
    if cache_cfg.prefix_caching and not prefix_caching:
        logger.info("prefix caching is off: %s", note)
    bm = BlockManager(
        num_blocks, cache_cfg.block_size, prefix_caching, cache_cfg.prefix_cache_n, copy_fn, groups.windows
    )
    return bm, prefix_caching, note


def _speculative_decoder(
    speculative, draft, draft_spec, cache_cfg, sched_cfg, block_manager, device, dtype
) -> SpeculativeDecoder | None:
    """Speculative decoding as configured (None: off); a draft model's cache draws from the
    engine's block pool."""
    if speculative is None:
        return None
    draft_model = None
    if draft is not None:
        draft_model = DraftModel(
            draft,
            draft_spec,
            cache_cfg,
            block_manager,
            device,
            dtype,
            sched_cfg.max_num_batched_tokens,
            speculative.draft_vocab,
            speculative.draft_weights,
        )
    return SpeculativeDecoder(speculative, sched_cfg.max_model_len, draft=draft_model)


def _build_kv(
    loaded: LoadedModel,
    cache_cfg: CacheConfig,
    sched_cfg: SchedulerConfig,
    device: torch.device,
    dtype: torch.dtype,
    executor,
    draft: LoadedModel | None,
):
    """The KV groups, block price, pool plan and rank 0's paged cache (with its backend and
    prefix-copy function), a draft model's groups drawing from the same pool; under tensor or
    pipeline parallelism the other ranks build theirs as rank 0 does and repeat its cache
    operations."""
    cfg = loaded.config
    # Layers that attend alike share a block table; sliding and global layers do not.
    groups = plan_groups(cfg.layer_windows, cfg.num_layers, hybrid=cache_cfg.paged_attention)
    kv_spec = (
        executor.kv_spec(loaded, cache_cfg, dtype, groups)
        if executor is not None
        else kv_spec_of(loaded, cache_cfg, dtype, groups)
    )
    # The pool's tables per sequence: the target's groups, and a draft model's beside them.
    windows, draft_spec = list(groups.windows), None
    if draft is not None:
        draft_groups = draft_kv_groups(draft)
        draft_spec = kv_spec_of(draft, draft_cache_config(cache_cfg), dtype, draft_groups)
        windows += draft_groups.windows
    plan = plan_pool(kv_spec, cache_cfg, sched_cfg, device, windows, draft_spec)
    if draft is not None:
        plan.source += shared_pool_note(plan.num_blocks, kv_spec, draft_spec)
    if executor is not None:
        executor.setup(plan.num_blocks)
    make_kv = executor.build_kv if executor is not None else build_kv
    kv_cache, backend, copy_fn = make_kv(loaded, kv_spec, cache_cfg, plan.num_blocks, device, dtype, groups)
    if executor is not None:  # the other ranks repeat every cache operation
        backend, copy_fn = executor.recorded(backend, copy_fn)
        executor.gather_sizes(
            loaded.weights.resident_bytes if loaded.weights else 0, kv_cache.nbytes if kv_cache is not None else 0
        )
    return groups, kv_spec, draft_spec, plan, kv_cache, backend, copy_fn
