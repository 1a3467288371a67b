"""One-kernel RMSNorm (with the residual add before it), rotary embedding
and SiLU·mul for eager CUDA tensors, where plain torch ops take several
kernels each.

Each rounds where the eager ops round, without contraction and with IEEE
division and exponent, so rotary and SiLU·mul give the eager ops' bits;
RMSNorm's sum of squares adds in another order, so it may differ in the last
bit of float32.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from sgl_piecewise.checks import check_tensor
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.internals.triton_jit import runs_compiled

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - the plain formulas serve without Triton
    triton = None

# The eager ops do not contract a multiply and an add into one rounding.
_EXACT = {"enable_fp_fusion": False}


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def eager(x: torch.Tensor) -> bool:
    """Run these kernels? Eagerly on CUDA only: compiled, Inductor fuses the plain formula."""
    return not torch.compiler.is_compiling() and available(x)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        d_ptr,
        sum_ptr,
        w_ptr,
        out_ptr,
        stride_x,
        stride_d,
        stride_sum,
        stride_out,
        H,
        eps,
        BLOCK: tl.constexpr,
        ADD: tl.constexpr,
        LIBDEVICE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if ADD:  # x + d, rounded once to the dtype as torch's add rounds, is the row normalised
            d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
        xf = x.to(tl.float32)
        mean = tl.sum(xf * xf, axis=0) / H
        if LIBDEVICE:
            inv = libdevice.rsqrt(mean + eps)  # CUDA's rsqrtf, as torch.rsqrt
        else:
            inv = tl.math.rsqrt(mean + eps)
        normed = (xf * inv).to(x.dtype)  # xf.to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)  # weight * normed
        tl.store(out_ptr + row * stride_out + cols, out, mask=mask)

    @triton.jit
    def _rotary_kernel(
        x_ptr,
        pos_ptr,
        cache_ptr,
        out_ptr,
        stride_xt,
        stride_xh,
        stride_ot,
        stride_oh,
        stride_c,
        HALF: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        i = tl.arange(0, BLOCK)
        mask = i < HALF
        p = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cache_ptr + p * stride_c + i, mask=mask, other=0.0)
        sin = tl.load(cache_ptr + p * stride_c + HALF + i, mask=mask, other=0.0)
        src = x_ptr + t * stride_xt + h * stride_xh
        x1 = tl.load(src + i, mask=mask, other=0.0)
        x2 = tl.load(src + HALF + i, mask=mask, other=0.0)
        dt = x1.dtype
        cf, sf, x1f, x2f = cos.to(tl.float32), sin.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32)
        # x1 * cos - x2 * sin and x2 * cos + x1 * sin, each product rounded as its own op.
        first = ((x1f * cf).to(dt).to(tl.float32) - (x2f * sf).to(dt).to(tl.float32)).to(dt)
        second = ((x2f * cf).to(dt).to(tl.float32) + (x1f * sf).to(dt).to(tl.float32)).to(dt)
        dst = out_ptr + t * stride_ot + h * stride_oh
        tl.store(dst + i, first, mask=mask)
        tl.store(dst + HALF + i, second, mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, F, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + F + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        if LIBDEVICE:  # CUDA's expf and IEEE division, as F.silu
            silu = libdevice.div_rn(g, 1.0 + libdevice.exp(-g)).to(gate.dtype)
        else:
            silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)  # * up
        tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


# TRITON_INTERPRET=1: no libdevice, and bf16 rounding truncates (only float32 is exact there).
_LIBDEVICE = triton is not None and runs_compiled(_rms_norm_kernel)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` with a unit last stride (a view when it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype)``."""
    check_tensor("weight", weight, shape=(x.shape[-1],), dtype=x.dtype, device=x.device)
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(rows, None, None, weight, out, eps)
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(y, rms_norm(y))`` with ``y = x + delta``, in one kernel, as the two ops give it."""
    check_tensor("delta", delta, shape=tuple(x.shape), dtype=x.dtype, device=x.device)
    check_tensor("weight", weight, shape=(x.shape[-1],), dtype=x.dtype, device=x.device)
    rows, deltas = _rows(x), _rows(delta)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(rows, deltas, y, weight, out, eps)
    return y.view(x.shape), out.view(x.shape)


def _launch_rms_norm(
    rows: torch.Tensor,
    deltas: Optional[torch.Tensor],
    sums: Optional[torch.Tensor],
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
) -> None:
    """One program per row; with ``deltas``, ``rows + deltas`` (written to ``sums``) is normalised."""
    if not rows.shape[0]:
        return
    h = rows.shape[1]
    block = triton.next_power_of_2(h)
    add = deltas is not None
    d, s = (deltas, sums) if add else (rows, out)  # unread where ADD is off
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        d,
        s,
        weight,
        out,
        rows.stride(0),
        d.stride(0),
        s.stride(0),
        out.stride(0),
        h,
        eps,
        BLOCK=block,
        ADD=add,
        LIBDEVICE=_LIBDEVICE,
        num_warps=min(16, max(1, block // 256)),
        **_EXACT,
    )


def rotary(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, D]`` rotated by ``positions`` ("rotate half")."""
    check_tensor("x", x, shape=(None, None, None))
    tokens, heads, dim = x.shape
    check_tensor("positions", positions, shape=(tokens,), dtype=(torch.int32, torch.int64), device=x.device)
    check_tensor("cos_sin_cache", cos_sin_cache, shape=(None, dim), dtype=x.dtype, device=x.device)
    if dim % 2 or cos_sin_cache.stride(1) != 1:
        raise InvalidInputError(
            f"rotary: expected an even head size and a cos_sin_cache with unit last stride, got head size {dim} "
            f"and strides {cos_sin_cache.stride()}"
        )
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens and heads:
        if x.stride(2) != 1:
            x = x.contiguous()
        if positions.stride(0) != 1:
            positions = positions.contiguous()
        half = dim // 2
        _rotary_kernel[(tokens, heads)](
            x,
            positions,
            cos_sin_cache,
            out,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            cos_sin_cache.stride(0),
            HALF=half,
            BLOCK=triton.next_power_of_2(half),
            num_warps=1,
            **_EXACT,
        )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` of ``gate_up [..., 2F]`` split in halves."""
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise InvalidInputError(f"silu_mul: expected gate_up [..., 2F], got shape {list(gate_up.shape)}")
    rows = _rows(gate_up)
    f = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], f), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and f:
        block = min(1024, triton.next_power_of_2(f))
        grid = (rows.shape[0], triton.cdiv(f, block))
        _silu_mul_kernel[grid](
            rows, out, rows.stride(0), out.stride(0), f, BLOCK=block, LIBDEVICE=_LIBDEVICE, num_warps=4, **_EXACT
        )
    return out.view(*gate_up.shape[:-1], f)
