"""The mixture-of-experts block shared by the MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE).

- Routing as transformers does it: the router's logits in float32, a softmax, then the top k
  by `torch.topk` on the same values (so ties break the same way), renormalized to sum to one
  where the config says (`norm_topk_prob`; Mixtral always, which equals a softmax over the
  top k logits).
- The experts run grouped: the (row, slot) pairs are sorted by expert id, each active expert
  takes all of its rows in one matmul (its gate|up, silu(gate) * up, down), and the results
  are scattered back with their routing weights by `index_add_`, experts in ascending order
  as transformers adds them. The Python loop is over the step's *active experts*, never over
  rows.
- Each expert is an `MLP` of `Linear` layers, so quantized experts stay quantized in the
  packed layout the dense kernels use (quant/kernels.py), and a step's few decode rows per
  expert take the integer kernels. A step of up to INT_ROWS rows (decode, batch 1 to 32) runs
  all of a layer's routed experts in one native call (`quant_moe_experts`): no Python loop, and
  the threads split every active expert's rows at once; called from the decoder layer, the
  norm, router, top k and residual add join that call (`quant_moe_block`).
- Qwen2-MoE adds a shared expert, scaled by sigmoid(shared_expert_gate(x)), to every row.
- Tensor parallelism: every rank routes every row (the router is replicated) and holds a slice
  of each expert's intermediate rows (and of the shared expert's), as the dense MLP is split;
  the weighted sum of partial expert outputs is summed across ranks by one all-reduce.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..quant import kernels as qk
from ..quant.formats import QuantTensor
from .linear import Linear
from .llama import MLP, DecoderLayer, LlamaForCausalLM, RMSNorm
from .parallel import ShardLayout


def route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from float32 router logits [T, E]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoE(nn.Module):
    """The routed experts of one layer (plus Qwen2-MoE's shared expert): a drop-in for `MLP`."""

    def __init__(
        self, cfg: ModelConfig, weights_in_compute_dtype: bool = True, shard: ShardLayout | None = None, tp=None
    ) -> None:
        super().__init__()
        self.tp = tp  # set: this rank's experts are slices, summed after the weighted sum
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        # Qwen/OLMoE round the routing weights to the compute dtype before scaling; Mixtral
        # scales in float32 and rounds the product.
        self.weights_in_compute_dtype = weights_in_compute_dtype
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.gate.keep_float = True  # ISQ leaves it (as llama.cpp's quantizer leaves ffn_gate_inp)
        inter = shard.expert_inter if tp is not None else cfg.moe_intermediate_size
        # No `tp` on the experts' down projections: one all-reduce serves the whole block.
        self.experts = nn.ModuleList(MLP(cfg, inter=inter) for _ in range(cfg.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            shared = shard.shared_inter if tp is not None else cfg.shared_expert_intermediate_size
            self.shared_expert = MLP(cfg, inter=shared)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
            self.shared_expert_gate.keep_float = True
        self._last_ids: torch.Tensor | None = None  # the last call's expert ids (trace)
        self._stack_ids: tuple | None = None  # (MoeStack, layer): the last step ran in the all-layer decode
        self._native: qk.MoeExperts | None | bool = False  # False: not looked at yet (weights load later)
        self._router32: torch.Tensor | None = None
        self.norm_type: type | None = None  # the type of forward's `norm` (set by the decoder layer)

    def forward(
        self, x: torch.Tensor, norm: nn.Module | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """residual + sum over the row's top k experts of weight * expert(norm(x)) (+ the shared expert)."""
        self._stack_ids = None
        if x.shape[0] <= qk.int_rows() and residual is x and self._fused_block(type(norm)):
            out, self._last_ids = qk.moe_block(
                x,
                norm.weight,
                norm.eps,
                self._router32,
                self.top_k,
                self.renormalize,
                self.weights_in_compute_dtype,
                self._native,
            )
            return out
        h = norm(x) if norm is not None else x
        weights, ids = route(self.router_logits(h), self.top_k, self.renormalize)
        if self.weights_in_compute_dtype:
            weights = weights.to(h.dtype)
        out = self.run_experts(h, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        return out if residual is None else residual + out

    def router_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[T, E] float32."""
        if self.gate.qparts is not None:
            return qk.matmul(h, self.gate.qparts, out_dtype=torch.float32)
        return F.linear(h.float(), self.gate.weight.float())

    @property
    def last_counts(self) -> list[int]:
        """Rows routed to each expert in the last call (for `pagedllm trace`)."""
        ids = self._last_ids if self._stack_ids is None else self._stack_ids[0].last_ids(self._stack_ids[1])
        if ids is None:
            return []
        return torch.bincount(ids.reshape(-1), minlength=self.num_experts).tolist()

    def stack_entry(self, norm_type: type) -> tuple | None:
        """This block as the native all-layer decode runs it (`qk.moe_stack`'s entry): where a
        step of few rows runs it in one native call (`_fused_block`), else None."""
        if not self._fused_block(norm_type):
            return None
        return self._router32, self._native, self.top_k, self.renormalize, self.weights_in_compute_dtype

    def ids_from(self, stack, layer: int) -> None:
        """The last step ran this block in the all-layer decode: its expert ids are the stack's."""
        self._stack_ids = (stack, layer)

    def run_experts(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows grouped by expert: one matmul chain per active expert, scattered back weighted
        (few rows of quantized experts: all of it in one native call)."""
        self._last_ids = ids
        if h.shape[0] <= qk.int_rows() and self._native_experts() is not None:
            return qk.moe_experts(h, ids, weights, self._native).to(h.dtype)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = order // k  # the token of each sorted (token, slot) pair
        w = weights.reshape(-1)[order].unsqueeze(1)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(h)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = rows[start : start + n]
            y = self.experts[e](h.index_select(0, idx))
            out.index_add_(0, idx, (y * w[start : start + n]).to(out.dtype))
            start += n
        return out

    def _fused_block(self, norm_type: type) -> bool:
        """Whether a step of few rows runs the whole block in one native call (`moe_block`): the
        experts quantized for `quant_moe_experts`, an RMSNorm before it and its input added
        after (as the decoder layer calls it), a float router, no shared expert, one rank."""
        if (
            norm_type is not RMSNorm
            or self.shared_expert is not None
            or self.tp is not None
            or self.gate.qparts is not None
            or self.gate.bias is not None
            or self._native_experts() is None
        ):
            return False
        if self._router32 is None:  # the router's float32 weight, copied once
            self._router32 = self.gate.weight.detach().float().contiguous()
        return True

    def _native_experts(self) -> qk.MoeExperts | None:
        """The experts' weights for `quant_moe_experts`, gathered once; None where that call
        does not apply: an expert in float, one reading its input permuted, or a library
        without the call."""
        plan = self._native
        if plan is False:
            plan = self._native = None
            if qk.moe_experts_available() and all(
                p.qparts is not None and not p.permutes and (p is m.gate_up_proj or len(p.qparts) == 1)
                for m in self.experts
                for p in (m.gate_up_proj, m.down_proj)
            ):
                plan = self._native = qk.MoeExperts.of(
                    [m.gate_up_proj.qparts for m in self.experts], [m.down_proj.qparts[0] for m in self.experts]
                )
        return plan

    def path(self) -> str:
        """How the experts run (for `pagedllm trace`)."""
        mlp = self.experts[0]
        parts = mlp.gate_up_proj.qparts
        head = (
            f"{self.num_experts} experts, top-{self.top_k}"
            f"{', shared expert' if self.shared_expert is not None else ''}: "
        )
        loop = (
            "rows sorted by expert id, one matmul chain per active expert (a Python loop over the "
            "active experts; {}), scattered back with index_add_"
        )
        if not parts:
            return head + loop.format(f"{mlp.gate_up_proj.weight.dtype} GEMMs")
        fmts = "/".join(sorted({p.fmt for p in parts}))
        if self._native_experts() is None:
            return head + loop.format(
                f"quantized {fmts}, integer kernel up to {qk.int_rows()} rows an expert, dequantize + GEMM beyond"
            )
        fused = (
            "the block from its norm to its residual add (router, softmax, top k too: quant_moe_block)"
            if self._fused_block(self.norm_type)
            else "the routed experts (quant_moe_experts)"
        )
        return (
            head + f"quantized {fmts}; steps of up to {qk.int_rows()} rows run {fused} in one native call: "
            "rows grouped by expert id, every active expert's rows through the integer kernels, the "
            "threads over all of them at once, summed by weight (a decode step runs it inside the all-layer "
            "native decode, beside the attention halves, where every layer allows); wider steps "
            + loop.format("dequantize + GEMM")
        )


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer whose MLP is the sparse block where the config says (else dense)."""

    weights_in_compute_dtype = True
    stack_decode = True  # the all-layer decode runs the sparse block whole (SparseMoE.stack_entry)

    def __init__(self, cfg: ModelConfig, layer_idx: int, shard=None, tp=None) -> None:
        super().__init__(cfg, layer_idx, shard, tp)
        if cfg.moe_layers[layer_idx]:
            self.mlp = SparseMoE(cfg, self.weights_in_compute_dtype, shard, tp)
            self.mlp.norm_type = type(self.post_attention_layernorm)  # what forward's `norm` will be (trace)


# A checkpoint's names for an expert's projections (Mixtral's w1/w3/w2, the Qwen/OLMoE names).
_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_W_NAMES = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}
# transformers' in-memory layout: all experts in one 3-D tensor (gate|up rows, then down).
_FUSED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)$")


class MoeForCausalLM(LlamaForCausalLM):
    layer_cls = MoeDecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int, tp=None, stage=None) -> None:
        if len(cfg.moe_layers) != cfg.num_layers:
            raise ValueError(f"{cfg.architecture}: the config names no experts (num_experts / num_local_experts)")
        super().__init__(cfg, max_positions, tp, stage)

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the block
        name = _MIXTRAL_EXPERT.sub(lambda m: f".experts.{m.group(1)}.{_W_NAMES[m.group(2)]}.", name)
        return super().map_weight_name(name)

    def shard_slice(self, name: str, shard: int | None) -> tuple[int, int, int] | None:
        """The experts' (and shared expert's) slices are their own intermediate rows, not the
        dense MLP's."""
        cut = super().shard_slice(name, shard)
        if cut is None or (".experts." not in name and ".shared_expert." not in name):
            return cut
        sh = self.shard
        start, n = (
            (sh.expert_inter_start, sh.expert_inter)
            if ".experts." in name
            else (sh.shared_inter_start, sh.shared_inter)
        )
        return cut[0], start, n

    def expert_paths(self) -> list[tuple[int, SparseMoE]]:
        return [
            (i, layer.mlp)
            for i, layer in enumerate(self.layers)
            if self.stage.holds(i) and isinstance(layer.mlp, SparseMoE)
        ]

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantTensor]], dtype: torch.dtype = torch.float32
    ) -> None:
        super().load_weights(_split_fused_experts(weights, self.config), dtype)


def _split_fused_experts(
    weights: Iterable[tuple[str, torch.Tensor | QuantTensor]], cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """transformers' 3-D `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] as
    the per-expert matrices the model holds."""
    for name, t in weights:
        m = _FUSED_EXPERTS.fullmatch(name)
        if m is None or isinstance(t, QuantTensor):
            yield name, t
            continue
        prefix, kind = m.groups()
        e, inter, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        want = (e, 2 * inter, hidden) if kind == "gate_up_proj" else (e, hidden, inter)
        if tuple(t.shape) != want:
            raise ValueError(
                f"weight {name!r} has shape {tuple(t.shape)}, expected {want} "
                f"({e} experts of intermediate size {inter})"
            )
        for i in range(e):
            if kind == "gate_up_proj":
                yield f"{prefix}.{i}.gate_proj.weight", t[i, :inter]
                yield f"{prefix}.{i}.up_proj.weight", t[i, inter:]
            else:
                yield f"{prefix}.{i}.down_proj.weight", t[i]
