"""Which slice of each weight a tensor-parallel rank holds (Megatron-style).

- q/k/v and gate/up are column-parallel: a rank holds whole attention heads (q by query head,
  k/v by KV head) and a contiguous run of the MLP's intermediate rows; its attention and
  activation need nothing from the other ranks.
- o_proj and down_proj are row-parallel: a rank holds the input columns matching its heads /
  intermediate rows, and the partial outputs are summed by one all-reduce each.
- The embedding and lm_head are vocab-parallel: a rank holds ceil(V / tp) rows. For the small
  models this engine serves on CPUs the vocabulary is the largest weight (SmolLM2: 28M of
  135M parameters, Qwen2.5-0.5B: 136M of 494M), and the head is the largest matmul of a
  decode step, so replicating it would keep most of the bytes and work on every rank. The
  embedding lookup is a masked local lookup plus an all-reduce (exact: one rank adds its row
  to zeros); the head's logits are gathered to rank 0, which samples (its sampler needs the
  whole row for top-p, penalties and grammar masks anyway).
- With fewer KV heads than ranks, each KV head is held by tp / num_kv_heads ranks (vLLM's
  replication), so a rank's query heads always find their KV head locally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..quant.formats import FORMATS, QuantTensor


def check_tp(cfg: ModelConfig, size: int) -> None:
    """Refuse a tensor-parallel size the model cannot be split by, saying which sizes fit."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    if cfg.architecture == "OlmoeForCausalLM":
        # Its q/k RMSNorms run over the whole q and k projections, which a rank holds a slice of.
        raise ValueError(
            "tensor parallelism does not split OLMoE: its q/k norms span all heads, which the "
            "ranks hold apart; use tensor_parallel_size=1"
        )
    fits = [n for n in range(2, 17) if _fits(cfg, n)]
    hint = f"sizes that fit this model: {fits}" if fits else "this model cannot be split"
    if cfg.num_heads % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {cfg.num_heads} attention heads; {hint}"
        )
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(
            f"tensor_parallel_size={size} and the model's {kv} KV heads: one must divide "
            f"the other (KV heads are split, or replicated when fewer); {hint}"
        )
    if cfg.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the MLP's intermediate size {cfg.intermediate_size}; {hint}"
        )
    for what, n in _moe_sizes(cfg):
        if n % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the {what} intermediate size {n}; {hint}")


def _moe_sizes(cfg: ModelConfig) -> list[tuple[str, int]]:
    """The intermediate sizes an MoE model splits besides the dense MLP's."""
    sizes = []
    if cfg.num_experts:
        sizes.append(("experts'", cfg.moe_intermediate_size))
    if cfg.shared_expert_intermediate_size:
        sizes.append(("shared expert's", cfg.shared_expert_intermediate_size))
    return sizes


def _fits(cfg: ModelConfig, n: int) -> bool:
    kv = cfg.num_kv_heads
    return (
        cfg.num_heads % n == 0
        and (kv % n == 0 or n % kv == 0)
        and cfg.intermediate_size % n == 0
        and all(size % n == 0 for _, size in _moe_sizes(cfg))
    )


@dataclass(frozen=True)
class ShardLayout:
    """Rank `rank` of `size`: its query heads, KV heads, intermediate rows and vocabulary rows."""

    rank: int
    size: int
    q_heads: int
    q_start: int
    kv_heads: int
    kv_start: int
    inter: int
    inter_start: int
    vocab: int  # rows of this rank's embedding / head shard
    vocab_start: int
    vocab_total: int
    # Mixtures of experts: each routed expert's (and the shared expert's) intermediate rows,
    # split as the dense MLP's are.
    expert_inter: int = 0
    expert_inter_start: int = 0
    shared_inter: int = 0
    shared_inter_start: int = 0

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int = 0, size: int = 1) -> "ShardLayout":
        check_tp(cfg, size)
        q = cfg.num_heads // size
        kv_total = cfg.num_kv_heads
        if kv_total >= size:
            kv, kv_start = kv_total // size, rank * (kv_total // size)
        else:  # replicated: ranks r*kv/size share one KV head
            kv, kv_start = 1, rank * kv_total // size
        inter = cfg.intermediate_size // size
        per = -(-cfg.vocab_size // size)
        v_start = min(rank * per, cfg.vocab_size)
        e_inter, s_inter = cfg.moe_intermediate_size // size, cfg.shared_expert_intermediate_size // size
        return cls(
            rank,
            size,
            q,
            rank * q,
            kv,
            kv_start,
            inter,
            rank * inter,
            min(per, cfg.vocab_size - v_start),
            v_start,
            cfg.vocab_size,
            e_inter,
            rank * e_inter,
            s_inter,
            rank * s_inter,
        )

    @property
    def sharded(self) -> bool:
        return self.size > 1


def narrow(t: torch.Tensor | QuantTensor, dim: int, start: int, length: int, name: str) -> torch.Tensor | QuantTensor:
    """t's slice [start, start + length) along dim. A quantized weight splits along rows freely;
    along columns only on its block boundaries, else it is dequantized (logged)."""
    if not isinstance(t, QuantTensor):
        return t.narrow(dim, start, length)
    rows, cols = t.shape
    if dim == 0:
        return QuantTensor(t.fmt, t.data[start : start + length], (length, cols))
    _, vals, nbytes = FORMATS[t.fmt]
    if start % vals == 0 and length % vals == 0:
        data = t.data[:, start // vals * nbytes : (start + length) // vals * nbytes].contiguous()
        return QuantTensor(t.fmt, data, (rows, length))
    import logging

    logging.getLogger(__name__).info(
        "%s: a %s weight's columns split at %d..%d, off its %d-value blocks; this rank holds its slice dequantized",
        name,
        t.fmt,
        start,
        start + length,
        vals,
    )
    from ..quant.kernels import dequantize_reference

    return dequantize_reference(t).narrow(1, start, length).contiguous()
