"""The f8e4m3 KV cache's calibration forward (kv/calibration.py has the scale arithmetic):
the model runs a fixed paragraph (a normal prefill, no KV cache) with each layer's attention
replaced by an observer that records amax(|K|) and amax(|V|) per kv head."""

from __future__ import annotations

import logging

import torch

from ..kv.calibration import HEADROOM, calibration_ids, checkpoint_fp8_scales, scales_from_amax
from .metadata import AttentionMetadata
from .paged import sdpa_one

logger = logging.getLogger(__name__)


class _AmaxObserver:
    """Stands in for a layer's attention during calibration: records K/V amax per head and
    attends the prompt's own K/V (no cache)."""

    def __init__(self, amax: torch.Tensor, window: int | None, scale: float) -> None:
        self.amax, self.window, self.scale = amax, window, scale

    def decode_qkv(self, qkv, rope, meta, hq, hkv):  # calibration is a prefill
        return None

    def stack_kv(self, dtype):
        return None

    def __call__(self, q, k, v, meta):
        for j, x in enumerate((k, v)):
            torch.maximum(self.amax[j], x.detach().float().abs().amax(dim=(0, 2)), out=self.amax[j])
        return sdpa_one(q, k, v, meta.prefill_mask(0, self.window, q.device), self.scale)


@torch.inference_mode()
def calibrate_kv_amax(model: torch.nn.Module, token_ids: list[int], device: torch.device) -> torch.Tensor:
    """amax(|K|), amax(|V|) per (layer, kv head), [num_layers, 2, H], over one prefill."""
    attns = model.attention_modules()
    heads = attns[0].num_kv_heads
    amax = torch.zeros(len(attns), 2, heads, device=device)
    saved = [a.attn for a in attns]
    n = len(token_ids)
    try:
        for i, a in enumerate(attns):
            a.attn = _AmaxObserver(amax[i], a.window, a.scale)
        meta = AttentionMetadata(num_decodes=0, seq_ids=[-1], query_start_loc=[0, n], context_lens=[n])
        ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        model(ids, torch.arange(n, device=device), meta)
    finally:
        for a, s in zip(attns, saved):
            a.attn = s
    return amax.cpu()


def resolve_fp8_scales(
    model: torch.nn.Module, tokenizer, kv_scales: dict, num_layers: int, num_kv_heads: int, device: torch.device
) -> tuple[torch.Tensor, str]:
    """(scales [num_layers, 2, H], where they came from) for an f8e4m3 cache; H is the model's
    KV heads on this rank (`num_kv_heads` is the checkpoint's total)."""
    ckpt = checkpoint_fp8_scales(kv_scales, num_layers, num_kv_heads)
    if ckpt is not None:
        sh = model.shard  # tensor parallelism: this rank's KV heads
        if sh is not None:
            ckpt = ckpt[:, :, sh.kv_start : sh.kv_start + sh.kv_heads].contiguous()
        return ckpt, "checkpoint"
    ids = calibration_ids(tokenizer, model.config.vocab_size)
    amax = calibrate_kv_amax(model, ids, device)
    scales = scales_from_amax(amax)
    note = f"calibrated at load: amax over {len(ids)} tokens x {HEADROOM:g} headroom, rounded up to a power of two"
    logger.info(
        "f8e4m3 KV scales %s (K %.3g..%.3g, V %.3g..%.3g)",
        note,
        scales[:, 0].min().item(),
        scales[:, 0].max().item(),
        scales[:, 1].min().item(),
        scales[:, 1].max().item(),
    )
    return scales, note
