"""RMSNorm, with the residual add before it (:func:`add_rms_norm`), and the
op that fuses both with the all-reduce before them.

``all_reduce_add_rms_norm(partial, residual, weight, eps, group_name) ->
(x, normed)`` (a ``torch.library`` custom op, namespace ``sgl_piecewise``):
``x = residual +`` the ranks' sum of ``partial``, and ``normed`` its
RMSNorm, in one FlashInfer kernel (``distributed/fused_norm.py``); for
wide rows (``fused_norm.fuses_norm``), where it is measured faster, that
kernel's all-reduce alone and then the add + RMSNorm kernel. A
row-parallel projection built where its group can fuse the three
(``TensorParallel.fuses_all_reduce_norm``) calls it
(``layers.add_projected_and_norm``); :func:`fuse_all_reduce_norms` turns
that off and on for a model's later traces. Out of place, with a fake
implementation, like the collectives (``distributed/comm_ops.py``): Dynamo
traces it as one node, and a CUDA graph captures it. Where no workspace
serves the call (more tokens than it holds, before
``prepare_communication``, inside ``nccl_only_all_reduces``), it runs the
all-reduce, the add and the norm one after the other: the same sums.
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
    scaled after casting back, in the same order as Hugging Face, so half
    precision matches it bit for bit (the fused kernel up to the order its
    sum of squares adds in)."""
    if elementwise.eager(x) and weight.dtype == x.dtype:  # else the formula promotes
        return elementwise.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, norm: "RMSNorm") -> Tuple[torch.Tensor, torch.Tensor]:
    """``(y, norm(y))`` with ``y = x + delta``: the residual add and the norm
    after it, in one kernel eagerly on CUDA (the same bits as the two ops),
    as written elsewhere (a compiled model fuses them itself)."""
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
    """``(x, norm(x))`` with ``x = residual +`` the sum of every rank's
    ``partial [T, H]``, through the op (module docstring)."""
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
    """What the fused kernel takes: partial sums and residual of one shape,
    a weight per column, all of one dtype."""
    same_shape = partial.shape == residual.shape and weight.shape == residual.shape[-1:]
    return same_shape and partial.dtype == weight.dtype == residual.dtype


@_all_reduce_add_rms_norm.register_fake
def _all_reduce_add_rms_norm_fake(partial, residual, weight, eps, group_name):
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


def fuse_all_reduce_norms(model: nn.Module, enabled: bool) -> int:
    """Let (``enabled``) or stop every row-parallel projection of ``model``
    that can fuse its all-reduce with the residual add and norm after it
    doing so, from the model's next trace (or eager call) on: a compiled
    model keeps what it was traced with. Returns how many can."""
    if not isinstance(enabled, bool):
        raise InvalidTypeError(f"enabled: expected a bool, got {enabled!r}")
    able = [m for m in model.modules() if getattr(m, "can_fuse_norm", False)]
    for module in able:
        module.fuses_norm = enabled
    return len(able)
