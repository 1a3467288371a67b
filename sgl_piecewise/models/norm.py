"""RMSNorm, with the residual add before it (:func:`add_rms_norm`), and the
custom op ``all_reduce_add_rms_norm`` that fuses both with the all-reduce
before them in one FlashInfer kernel (``distributed/fused_norm.py``). Out of
place with a fake implementation, like the collectives; where no workspace
serves a call, it runs the all-reduce, add and norm apart (the same sums).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

import torch
from torch import nn

from sgl_piecewise.distributed import comm_ops, fused_norm
from sgl_piecewise.errors import InvalidTypeError
from sgl_piecewise.ops.kernels import elementwise

if TYPE_CHECKING:
    from sgl_piecewise.distributed import TensorParallel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x**2) + eps))``, normalised in float32 and
    scaled after casting back, as Hugging Face does (bit for bit)."""
    if elementwise.eager(x) and weight.dtype == x.dtype:  # else the formula promotes
        return elementwise.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, norm: "RMSNorm") -> Tuple[torch.Tensor, torch.Tensor]:
    """``(y, norm(y))`` with ``y = x + delta``, in one kernel eagerly on CUDA."""
    return _add_rms_norm(x, delta, norm.weight, norm.eps)


def _add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    if elementwise.eager(x) and x.dtype == delta.dtype == weight.dtype and x.shape == delta.shape:
        return elementwise.add_rms_norm(x, delta, weight, eps)
    y = x + delta
    return y, rms_norm(y, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def all_reduce_add_rms_norm(
    tp: "TensorParallel", partial: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(x, norm(x))`` with ``x = residual +`` the ranks' sum of ``partial``, through the op."""
    return torch.ops.sgl_piecewise.all_reduce_add_rms_norm(partial, residual, norm.weight, norm.eps, tp.group_name)


@torch.library.custom_op("sgl_piecewise::all_reduce_add_rms_norm", mutates_args=())
def _all_reduce_add_rms_norm(
    partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_name: str
) -> Tuple[torch.Tensor, torch.Tensor]:
    workspace = None if comm_ops.nccl_only() else fused_norm.serving(group_name, residual)
    if workspace is not None and _kernel_operands(partial, residual, weight):
        if fused_norm.fuses_norm(partial.shape[1], partial.dtype):
            return fused_norm.add_rms_norm(workspace, partial, residual, weight, eps)
        return _add_rms_norm(residual, fused_norm.all_reduce(workspace, partial), weight, eps)
    return _add_rms_norm(residual, torch.ops.sgl_piecewise.all_reduce(partial, group_name), weight, eps)


def _kernel_operands(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    same_shape = partial.shape == residual.shape and weight.shape == residual.shape[-1:]
    return same_shape and partial.dtype == weight.dtype == residual.dtype


@_all_reduce_add_rms_norm.register_fake
def _all_reduce_add_rms_norm_fake(partial, residual, weight, eps, group_name):
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


def fuse_all_reduce_norms(model: nn.Module, enabled: bool) -> int:
    """Let (``enabled``) or stop ``model``'s row-parallel projections fusing the
    all-reduce with the add and norm, from its next trace on. Returns how many can."""
    if not isinstance(enabled, bool):
        raise InvalidTypeError(f"enabled: expected a bool, got {enabled!r}")
    able = [m for m in model.modules() if getattr(m, "can_fuse_norm", False)]
    for module in able:
        module.fuses_norm = enabled
    return len(able)
