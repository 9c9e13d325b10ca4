"""The native calls around the quantized projections that choose no route: the per-head q/k
and whole-row RMSNorms, and the LoRA and MoE stacks the all-layer decode (kernels.decode_layers) takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..native import cpu_kernels
from .formats import QuantTensor


@dataclass(frozen=True)
class MoeExperts:
    """One MoE layer's quantized experts as `quant_moe_experts` takes them: every expert's
    gate|up parts in one flat list with a count per expert, and one down part per expert."""

    gate_up: list[torch.Tensor]
    gate_up_types: list[int]
    gate_up_parts: list[int]
    down: list[torch.Tensor]
    down_types: list[int]

    @classmethod
    def of(cls, gate_up: list[list[QuantTensor]], down: list[QuantTensor]) -> "MoeExperts":
        flat = [p for parts in gate_up for p in parts]
        return cls(
            [p.data for p in flat],
            [p.type_id for p in flat],
            [len(parts) for parts in gate_up],
            [d.data for d in down],
            [d.type_id for d in down],
        )


def qk_norm_available() -> bool:
    """Whether the native q/k RMSNorm (`qk_norm`) runs here (the kernels load)."""
    return cpu_kernels() is not None


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """`norm` (an RMSNorm module: weight, eps) of x [M, K] in one native call, as the fused
    projections' norms compute it (within a few float32 ulps of F.rms_norm); the module itself
    elsewhere (no native kernels, another device, a weight in another dtype)."""
    ops = cpu_kernels()
    if ops is None or x.dim() != 2 or x.device.type != "cpu" or norm.weight.dtype != x.dtype:
        return norm(x)
    return ops.rms_norm(x, norm.weight, norm.eps)


def qk_norm(
    qkv: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    clip: float | None = None,
) -> torch.Tensor:
    """qkv [T, (hq + 2 hkv) d] with its q and k RMSNorms applied in place (over each head where
    the weights are head_dim long, else over the whole q and k parts), then clamped to +-clip
    where given: the quantized decode path's q/k norms, one native call instead of ATen's chain
    of small ops; the all-layer decode makes the same call."""
    cpu_kernels().qk_norm(qkv, wq, wk, num_heads, num_kv_heads, eps, float(clip or 0.0))
    return qkv


def moe_stack(entries: list[tuple | None]):
    """The native MoeStack `decode_layers` takes: per decoder layer None (a dense MLP) or a
    sparse block's (float32 router [E, H], its `MoeExperts`, top_k, renormalize, round_weights)."""
    stack = torch.classes.pagedllm.MoeStack()
    for e in entries:
        if e is None:
            stack.add_dense()
        else:
            router, ex, top_k, renormalize, round_weights = e
            stack.add_sparse(
                router,
                ex.gate_up,
                ex.gate_up_types,
                ex.gate_up_parts,
                ex.down,
                ex.down_types,
                top_k,
                renormalize,
                round_weights,
            )
    return stack


def lora_stack(a: list, panels: list, index: list, slots: int):
    """The native LoRAStack `decode_layers` takes: entry j * slots + s is projection j's A,
    B^T's panels and their index for the step's s-th slot (None: that slot leaves it alone)."""
    return torch.classes.pagedllm.LoRAStack(a, panels, index, slots)
