"""The models' linear layer: nn.Linear, except that decode at batch 1-2 on the CPU with
bf16 weights goes to the native matrix-vector product, which streams the weight at about
twice the rate oneDNN's GEMM reaches at that size (weights, not arithmetic, bound it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..native import cpu_kernels

MAX_ROWS = 2  # from three rows on oneDNN's blocked GEMM is as fast or faster


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.dim() == 2 and x.shape[0] <= MAX_ROWS and w.dtype == torch.bfloat16
                and w.device.type == "cpu" and w.is_contiguous() and not torch.is_grad_enabled()):
            native = cpu_kernels()
            if native is not None:
                y = native.linear_small_m(x, w)
                return y if self.bias is None else y + self.bias
        return F.linear(x, w, self.bias)
