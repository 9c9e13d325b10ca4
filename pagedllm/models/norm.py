"""RMSNorm, the norm every family here uses (Gemma's 1 + weight is folded into its weights at load)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op (fp32 accumulation inside) instead of six.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
