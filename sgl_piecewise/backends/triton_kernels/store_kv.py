"""The new tokens' K/V written into the paged pool, and padded output rows
zeroed, in one launch (before extend attention). One program per row: a
real row copies its K and V bit for bit to ``out_cache_loc[t]``; a padded
row zeroes its output row, which no attention program covers.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from sgl_piecewise.internals.triton_launch import FastLauncher


@triton.jit
def _store_kv_kernel(
    new_k_ptr,
    new_v_ptr,
    k_ptr,
    v_ptr,
    loc_ptr,
    out_ptr,
    num_rows,
    stride_nkt,
    stride_nkh,
    stride_nvt,
    stride_nvh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    HKV: tl.constexpr,
    HQ: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # Grid: (rows,). int64: a row or slot times its stride can pass 2**31.
    t = tl.program_id(0).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV)
    if t >= num_rows:
        heads = tl.arange(0, BLOCK_HQ)
        mask = (heads[:, None] < HQ) & (offs_dv[None, :] < DV)
        zeros = tl.zeros([BLOCK_HQ, BLOCK_DV], dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :], zeros, mask=mask)
        return
    slot = tl.load(loc_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_HKV)
    offs_d = tl.arange(0, BLOCK_D)
    mask_k = (heads[:, None] < HKV) & (offs_d[None, :] < D)
    k = tl.load(new_k_ptr + t * stride_nkt + heads[:, None] * stride_nkh + offs_d[None, :], mask=mask_k)
    tl.store(k_ptr + slot * stride_kt + heads[:, None] * stride_kh + offs_d[None, :], k, mask=mask_k)
    mask_v = (heads[:, None] < HKV) & (offs_dv[None, :] < DV)
    v = tl.load(new_v_ptr + t * stride_nvt + heads[:, None] * stride_nvh + offs_dv[None, :], mask=mask_v)
    tl.store(v_ptr + slot * stride_vt + heads[:, None] * stride_vh + offs_dv[None, :], v, mask=mask_v)


launch_store_kv = FastLauncher(_store_kv_kernel)


@functools.lru_cache(maxsize=64)
def store_kv_meta(num_kv_heads: int, num_q_heads: int, head_dim: int, dv: int) -> dict:
    """Compile-time arguments of the kernel (cached: built once per step)."""
    return dict(
        HKV=num_kv_heads,
        HQ=num_q_heads,
        D=head_dim,
        DV=dv,
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(dv),
        num_warps=1 if num_q_heads * dv <= 1024 else 4,
    )


def store_kv_args(new_k, new_v, k_cache, v_cache, out_cache_loc, out, num_rows: int) -> tuple:
    """The kernel's runtime arguments, in its order; layer tensors first."""
    return (
        new_k, new_v, k_cache, v_cache, out_cache_loc, out, num_rows,
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
    )  # fmt: skip
