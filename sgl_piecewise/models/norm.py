"""RMSNorm, and the residual add before it in the same kernel.

A decoder layer adds each projection's output to the residual stream and
normalises the sum right after (``layers.add_projected_and_norm``):
:func:`add_rms_norm` does both, eagerly on CUDA in one kernel
(``fused_ops.add_rms_norm``), elsewhere as written (a compiled model fuses
them itself).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

from sgl_piecewise.models import fused_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x**2) + eps))``, normalised in float32 and
    scaled after casting back, in the same order as Hugging Face, so half
    precision matches it bit for bit (the fused kernel up to the order its
    sum of squares adds in)."""
    if fused_ops.eager(x) and weight.dtype == x.dtype:  # else the formula promotes
        return fused_ops.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, norm: "RMSNorm") -> Tuple[torch.Tensor, torch.Tensor]:
    """``(y, norm(y))`` with ``y = x + delta``: the residual add and the norm
    after it, in one kernel eagerly on CUDA (the same bits as the two ops),
    as written elsewhere."""
    if fused_ops.eager(x) and x.dtype == delta.dtype == norm.weight.dtype and x.shape == delta.shape:
        return fused_ops.add_rms_norm(x, delta, norm.weight, norm.eps)
    y = x + delta
    return y, norm(y)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
