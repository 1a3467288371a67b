"""A decoder layer's projections as custom ops fused with their neighbours:
``qkv_rope`` (RMSNorm, QKV, rotary), ``gate_up_silu`` (RMSNorm, gate/up,
SiLU·mul) and ``linear`` (with the residual add, or float32 logits). Dynamo
traces each as one node, so eager and every graph path run the same kernels.

Up to ``MAX_ROWS`` half-precision rows on CUDA take one Triton kernel
(``kernels/projection.py``); the rest take cuBLAS and the elementwise
kernels. The fused kernel scales by the norm after the product, so the two
paths agree within half-precision rounding, not bit for bit.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from sgl_piecewise.checks import check_tensor
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.ops.kernels import elementwise
from sgl_piecewise.ops.kernels import projection as kernels
from sgl_piecewise.ops.kernels.tilings import Tiling, rotary_kind, tiling_for

MAX_ROWS = kernels.MAX_ROWS
_HALF = (torch.bfloat16, torch.float16)


def _fused(x: torch.Tensor, *others: Optional[torch.Tensor]) -> bool:
    """Can the call take the fused kernel (every tensor with unit last stride)?"""
    return (
        kernels.triton is not None
        and x.is_cuda
        and x.dtype in _HALF
        and x.shape[0] <= MAX_ROWS
        and all(t is None or t.stride(-1) == 1 for t in (x, *others))
    )


def _tiling(kind: str, x: torch.Tensor, n: int) -> Optional[Tiling]:
    """The fused kernel's tiling, or None where the unfused ops measured faster."""
    return tiling_for(kind, x.shape[0], n, x.shape[1], x.device)


def _check_common(x, weight, norm_weight, bias, bias_rows: int) -> None:
    check_tensor("x", x, shape=(None, None))
    check_tensor("weight", weight, shape=(None, x.shape[1]), dtype=x.dtype, device=x.device)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, shape=(x.shape[1],), dtype=x.dtype, device=x.device)
    if bias is not None:
        check_tensor("bias", bias, shape=(bias_rows,), dtype=x.dtype, device=x.device)


def _tensors(**named: Optional[torch.Tensor]) -> None:
    """Before the dispatcher, whose error for a non-tensor names no argument."""
    for name, value in named.items():
        if value is not None:
            check_tensor(name, value)


def _normed(x: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """``x`` through RMSNorm as Hugging Face computes it, or ``x`` without a norm."""
    if norm_weight is None:
        return x
    if elementwise.available(x):
        return elementwise.rms_norm(x, norm_weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return norm_weight * xf.to(x.dtype)


def _check_qkv(x, weight, bias, positions, cos_sin_cache, num_heads, num_kv_heads, norm_weight) -> int:
    """The head size, after every check."""
    check_tensor("cos_sin_cache", cos_sin_cache, shape=(None, None), dtype=x.dtype, device=x.device)
    head_dim = cos_sin_cache.shape[1]
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads or head_dim % 2:
        raise InvalidInputError(
            f"qkv_rope: expected num_heads a positive multiple of num_kv_heads and an even head size, got "
            f"{num_heads}, {num_kv_heads} and head size {head_dim} (cos_sin_cache's width)"
        )
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    check_tensor("weight", weight, shape=(rows, None))
    _check_common(x, weight, norm_weight, bias, rows)
    check_tensor("positions", positions, shape=(x.shape[0],), dtype=(torch.int32, torch.int64), device=x.device)
    return head_dim


@torch.library.custom_op("sgl_piecewise::qkv_rope", mutates_args=())
def _qkv_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    norm_weight: Optional[torch.Tensor],
    eps: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    head_dim = _check_qkv(x, weight, bias, positions, cos_sin_cache, num_heads, num_kv_heads, norm_weight)
    heads = num_heads + 2 * num_kv_heads
    tiling = _fused(x, weight, bias, positions, cos_sin_cache, norm_weight) and _tiling(
        rotary_kind(head_dim), x, heads * (head_dim // 2)
    )
    if tiling:
        return kernels.qkv_rope(
            x, weight, bias, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim, norm_weight, eps, tiling
        )
    qkv = F.linear(_normed(x, norm_weight, eps), weight, bias)
    qk, v = qkv.split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], dim=-1)
    qk = qk.view(-1, num_heads + num_kv_heads, head_dim)
    return _rotary(positions, qk, cos_sin_cache), v.reshape(-1, num_kv_heads, head_dim).contiguous()


@_qkv_rope.register_fake
def _qkv_rope_fake(x, weight, bias, positions, cos_sin_cache, num_heads, num_kv_heads, norm_weight, eps):
    head_dim = _check_qkv(x, weight, bias, positions, cos_sin_cache, num_heads, num_kv_heads, norm_weight)
    rows = x.shape[0]
    return x.new_empty(rows, num_heads + num_kv_heads, head_dim), x.new_empty(rows, num_kv_heads, head_dim)


def _rotary(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, D]`` rotated by ``positions`` ("rotate half"), contiguous."""
    if elementwise.available(x):
        return elementwise.rotary(positions, x, cos_sin_cache)
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def qkv_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    norm_weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(qk [T, Hq + Hkv, D], v [T, Hkv, D])``: ``x`` through RMSNorm (none
    where ``norm_weight`` is None) and ``weight``, q's and k's heads rotated
    by ``positions`` with ``cos_sin_cache [P, D]`` (cos half, then sin)."""
    _tensors(x=x, weight=weight, bias=bias, positions=positions, cos_sin_cache=cos_sin_cache, norm_weight=norm_weight)
    return torch.ops.sgl_piecewise.qkv_rope(
        x, weight, bias, positions, cos_sin_cache, num_heads, num_kv_heads, norm_weight, eps
    )


def _check_gate_up(x, weight, norm_weight) -> None:
    _check_common(x, weight, norm_weight, None, 0)
    if weight.shape[0] % 2:
        raise InvalidInputError(
            f"gate_up_silu: expected weight [2F, H] (gate rows, then up rows), got {list(weight.shape)}"
        )


@torch.library.custom_op("sgl_piecewise::gate_up_silu", mutates_args=())
def _gate_up_silu(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    _check_gate_up(x, weight, norm_weight)
    tiling = _fused(x, weight, norm_weight) and _tiling("silu", x, weight.shape[0] // 2)
    if tiling:
        return kernels.gate_up_silu(x, weight, norm_weight, eps, tiling)
    gate_up = F.linear(_normed(x, norm_weight, eps), weight)
    if elementwise.available(gate_up):
        return elementwise.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@_gate_up_silu.register_fake
def _gate_up_silu_fake(x, weight, norm_weight, eps):
    _check_gate_up(x, weight, norm_weight)
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


def gate_up_silu(
    x: torch.Tensor, weight: torch.Tensor, *, norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6
) -> torch.Tensor:
    """``silu(gate) * up`` with ``[gate, up] = rms_norm(x) @ weight.T`` (gate rows first)."""
    _tensors(x=x, weight=weight, norm_weight=norm_weight)
    return torch.ops.sgl_piecewise.gate_up_silu(x, weight, norm_weight, eps)


def _check_linear(x, weight, bias, residual, logits) -> None:
    _check_common(x, weight, None, bias, weight.shape[0])
    if residual is not None:
        if logits:
            raise InvalidInputError("linear: expected no residual with float32 logits")
        check_tensor("residual", residual, shape=(x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)


@torch.library.custom_op("sgl_piecewise::linear", mutates_args=())
def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    float32_out: bool,
) -> torch.Tensor:
    _check_linear(x, weight, bias, residual, float32_out)
    tiling = _fused(x, weight, bias, residual) and _tiling("linear", x, weight.shape[0])
    if tiling:
        out_dtype = torch.float32 if float32_out else None
        return kernels.linear(x, weight, bias, residual, out_dtype=out_dtype, tiling=tiling)
    if float32_out:
        return _float32_logits(x, weight, bias)
    if residual is None:
        return F.linear(x, weight, bias)
    if x.is_cuda:  # one cuBLAS call: residual + x @ W.T, summed in float32 and rounded once
        return torch.addmm(residual if bias is None else residual + bias, x, weight.t())
    return residual + F.linear(x, weight, bias)


def _float32_logits(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """On CUDA one matmul writes float32 (``linear(...).float()`` would round to half first)."""
    if x.is_cuda and x.dtype in _HALF and bias is None:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x, weight, bias).float()


@_linear.register_fake
def _linear_fake(x, weight, bias, residual, float32_out):
    _check_linear(x, weight, bias, residual, float32_out)
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32 if float32_out else x.dtype)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    residual: Optional[torch.Tensor] = None,
    float32_out: bool = False,
) -> torch.Tensor:
    """``[residual +] x @ weight.T [+ bias]``, in ``x``'s dtype or float32
    with ``float32_out`` (logits: no residual)."""
    _tensors(x=x, weight=weight, bias=bias, residual=residual)
    return torch.ops.sgl_piecewise.linear(x, weight, bias, residual, float32_out)
