"""The models' linear layer and embedding: nn.Linear / nn.Embedding, plus two CPU paths.

- Quantized weights (GGUF blocks or ISQ): the layer holds `QuantTensor` parts instead of a
  float weight; a fused projection may have parts in different formats (Q4_K_M files keep
  v in Q6_K beside q/k in Q4_K). quant/kernels.py picks the integer kernel or the
  dequantize + GEMM route by row count.
- Decode at batch 1-2 with bf16 weights goes to the native matrix-vector product, which
  streams the weight at about twice the rate oneDNN's GEMM reaches at that size (weights,
  not arithmetic, bound it).
- Tensor parallelism (models/parallel.py): a row-parallel layer (`tp` set) computes its partial
  product, all-reduces it, then adds the bias and the residual once; a vocab-parallel
  embedding looks up only its rows and all-reduces.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..native import cpu_kernels
from ..quant import kernels as qk
from ..quant.formats import QuantTensor

MAX_ROWS = 2  # from three rows on oneDNN's blocked GEMM is as fast or faster


class Linear(nn.Linear):
    qparts: list[QuantTensor] | None = None
    tp = None  # a TPInfo on row-parallel layers (o_proj, down_proj) under tensor parallelism
    # GPTQ desc_act: the quantized columns are stored sorted by group, so the input's columns are
    # permuted to match, once per call; one permutation for the layer, or one per part where a
    # fused projection's parts were quantized with different orders (then each part runs alone).
    in_perm: torch.Tensor | None = None
    part_perms: list[torch.Tensor | None] | None = None
    # LoRA adapter slots (pagedllm/lora/layers.py: LinearLoRA), set by the LoRA manager; when a
    # step has rows with an adapter (`lora.active`) the layer adds their low-rank products.
    lora = None
    # Which projection this is (quant.kernels.ROLES: its attribute name), set at load where the
    # weight is quantized: it chooses the activation rounding on wide steps.
    act_role: str | None = None

    def set_quantized(self, parts: list[QuantTensor]) -> None:
        """Hold `parts` (stacked by rows) as the weight; the float parameter goes away."""
        rows = sum(p.shape[0] for p in parts)
        if rows != self.out_features or any(p.shape[1] != self.in_features for p in parts):
            raise ValueError(
                f"quantized weight of {rows}x{parts[0].shape[1]} for a {self.out_features}x{self.in_features} layer"
            )
        self.qparts = qk.pack(parts)
        self.weight = None  # nn.Module keeps the slot; parameters() skips it
        perms = [p.col_perm for p in parts]
        self.in_perm = self.part_perms = None
        if all(p is None for p in perms):
            return
        if all(p is not None and torch.equal(p, perms[0]) for p in perms):
            self.in_perm = perms[0]
        else:
            self.part_perms = perms

    @property
    def permutes(self) -> bool:
        """Whether the quantized weight reads its input's columns out of order."""
        return self.in_perm is not None or self.part_perms is not None

    def fused(
        self,
        x: torch.Tensor,
        norm: nn.Module | None = None,
        residual: torch.Tensor | None = None,
        silu_mul: bool = False,
    ) -> torch.Tensor:
        """residual + act(self(norm(x))), where act is silu(gate) * up over the output's halves.
        With quantized weights and few rows it is one native call (the norm, the bias, the
        activation and the residual folded into the projection); otherwise the plain ops."""
        if self.tp is not None:  # row-parallel: sum the ranks' partial products, then the rest
            y = self.tp.all_reduce(self._partial(x if norm is None else norm(x)))
            if self.bias is not None:
                y = y + self.bias
            return y if residual is None else residual + y
        # Rows with an adapter take the plain ops below (forward adds their deltas before the
        # activation and the residual); the folded native call has no place for them yet.
        if (
            self.qparts is not None
            and x.dim() == 2
            and qk.integer_route(x.shape[0], self.qparts, self.act_role)
            and self.part_perms is None
            and (self.lora is None or not self.lora.active)
        ):
            if self.in_perm is not None:  # the norm before the permutation (its weight is in x's order)
                x = (norm(x) if norm is not None else x).index_select(1, self.in_perm)
                norm = None
            return qk.linear(x, self.qparts, norm, self.bias, residual, silu_mul, self.act_role)
        y = self(norm(x) if norm is not None else x)
        if silu_mul:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        return y if residual is None else residual + y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._partial(x)
        if self.tp is not None:
            y = self.tp.all_reduce(y)
        y = y if self.bias is None else y + self.bias
        if self.lora is not None and self.lora.active:
            y = self.lora.add(x, y)
        return y

    def _partial(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T without the bias (under tensor parallelism: this rank's share)."""
        if self.qparts is not None:
            x2 = x.reshape(-1, x.shape[-1])
            if self.part_perms is not None:
                y = torch.cat(
                    [
                        qk.matmul(x2 if p is None else x2.index_select(1, p), [w], role=self.act_role)
                        for w, p in zip(self.qparts, self.part_perms)
                    ],
                    dim=1,
                )
            else:
                y = qk.matmul(
                    x2 if self.in_perm is None else x2.index_select(1, self.in_perm), self.qparts, role=self.act_role
                )
            return y.view(*x.shape[:-1], self.out_features)
        w = self.weight
        if (
            x.dim() == 2
            and x.shape[0] <= MAX_ROWS
            and w.dtype == torch.bfloat16
            and w.device.type == "cpu"
            and w.is_contiguous()
            and not torch.is_grad_enabled()
        ):
            native = cpu_kernels()
            if native is not None:
                return native.linear_small_m(x, w)
        if x.dim() == 2:  # (whole buckets of rows: qk.gemm_rows)
            return F.linear(qk.pad_rows(x), w)[: x.shape[0]]
        return F.linear(x, w)


class Embedding(nn.Embedding):
    """An embedding table; quantized, a lookup dequantizes only the rows it reads.
    Vocab-parallel (`tp` set), it holds rows [vocab_start, vocab_start + num_embeddings)."""

    qweight: QuantTensor | None = None
    out_dtype: torch.dtype = torch.float32
    tp = None
    vocab_start = 0

    def set_quantized(self, w: QuantTensor, dtype: torch.dtype) -> None:
        if w.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"quantized embedding of {w.shape} for a {self.num_embeddings}x{self.embedding_dim} table")
        self.qweight, self.out_dtype = qk.pack([w])[0], dtype
        self.weight = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._lookup(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        h = self._lookup(local.masked_fill(outside, 0))
        return self.tp.all_reduce(h.masked_fill_(outside[..., None], 0))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return qk.embedding(self.qweight, ids.reshape(-1), self.out_dtype).view(*ids.shape, -1)
        return super().forward(ids)


def linear_weight_names(model: torch.nn.Module, keys: Iterable[str]) -> set[str]:
    """The checkpoint names that land in a Linear layer's weight (not embeddings or norms, nor
    layers marked `keep_float`: an MoE router, tiny and deciding which experts run)."""
    names = set()
    for key in keys:
        mapped = model.map_weight_name(key)
        if mapped is None or not mapped[0].endswith(".weight"):
            continue
        module = model.get_submodule(mapped[0].rsplit(".", 1)[0])
        if isinstance(module, Linear) and not getattr(module, "keep_float", False):
            names.add(key)
    return names
