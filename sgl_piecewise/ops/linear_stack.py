"""``stacked_linear``: several linears of one input, their outputs side by
side. Where the weights lie back to back in memory (as ``models.adapt`` lays
out a transformers layer's q/k/v and gate/up projections) it is one matmul
over them all; anywhere else one matmul each, concatenated, which is the
same result. The compiler's pass ``compile/stacked_linears.py`` writes it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from sgl_piecewise.checks import check_tensor
from sgl_piecewise.errors import InvalidInputError


def one_block(parts: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """``torch.cat(parts)`` as a view, where ``parts`` are contiguous and lie
    back to back in one storage, in order; else None."""
    first = parts[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for part in parts:
        if (
            not part.is_contiguous()
            or part.shape[1:] != first.shape[1:]
            or part.dtype != first.dtype
            or part.untyped_storage().data_ptr() != storage
            or part.storage_offset() != offset
        ):
            return None
        offset += part.numel()
    rows = sum(part.shape[0] for part in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def _check(x: torch.Tensor, weights: List[torch.Tensor], biases: List[torch.Tensor]) -> None:
    check_tensor("x", x)
    if not weights:
        raise InvalidInputError("stacked_linear: expected at least one weight, got none")
    if biases and len(biases) != len(weights):
        raise InvalidInputError(
            f"stacked_linear: expected no bias or one per weight ({len(weights)}), got {len(biases)}"
        )
    for i, weight in enumerate(weights):
        check_tensor(f"weights[{i}]", weight, shape=(None, x.shape[-1]), dtype=x.dtype, device=x.device)
        if biases:
            check_tensor(f"biases[{i}]", biases[i], shape=(weight.shape[0],), dtype=x.dtype, device=x.device)


@torch.library.custom_op("sgl_piecewise::stacked_linear", mutates_args=())
def _stacked_linear(x: torch.Tensor, weights: List[torch.Tensor], biases: List[torch.Tensor]) -> torch.Tensor:
    _check(x, weights, biases)
    weight = one_block(weights)
    if weight is None:
        return torch.cat([F.linear(x, w, biases[i] if biases else None) for i, w in enumerate(weights)], dim=-1)
    bias = None
    if biases:
        bias = one_block(biases)
        if bias is None:  # a copy of a few rows, where the weights are one block
            bias = torch.cat(biases)
    return F.linear(x, weight, bias)


@_stacked_linear.register_fake
def _stacked_linear_fake(x, weights, biases):
    _check(x, weights, biases)
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))


def stacked_linear(
    x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """``torch.cat([F.linear(x, w, b) for w, b in ...], dim=-1)``: no bias, or one per weight."""
    return torch.ops.sgl_piecewise.stacked_linear(x, list(weights), list(biases))
