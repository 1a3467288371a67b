"""Extend (prefill) attention: ragged requests' new tokens over their prefix +
new keys in the paged KV pool.

A program handles ``BLOCK_M`` rows of one (request, kv head); a row is a
(query token, query head) pair, the ``GROUP`` heads of a kv head packed
token-major, so each K/V tile serves all of them. Query token ``i`` sees keys
``j <= kv_len - q_len + i``, or, with a custom mask, those where
``mask[mask_indptr[r] + i * kv_len + j]``; rows that see no key get zeros.
Only the request's own ``kv_indices`` are loaded. The grid depends only on
``bs``, the head counts and the static ``max_q_len`` (graph-safe).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from sgl_piecewise.backends.triton_kernels.store_kv import launch_store_kv, store_kv_args, store_kv_meta
from sgl_piecewise.backends.triton_kernels.tiles import (
    check_attention_args,
    check_last_dim_contiguous,
    check_new_kv,
    check_num_rows,
    layer_layout,
    load_rows,
    mm,
    rebind_slots,
    softmax_step,
)
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.internals.triton_jit import runs_compiled
from sgl_piecewise.internals.triton_launch import FastLauncher, StepLaunch

# Tiles for sm_90: SGLang's extend kernel's, and elsewhere the largest that
# compiles for sm_90 without spilling registers or overflowing shared memory.
EXTEND_BLOCK_M, EXTEND_BLOCK_N = 128, 64  # 16-bit inputs, head_dim <= 128
LARGE_HEAD_BLOCK_M, LARGE_HEAD_BLOCK_N = 64, 32  # 16-bit inputs, head_dim > 128
# fp32 inputs run their dots as 3xTF32; larger tiles spill or overflow shared memory.
FP32_BLOCK_M, FP32_BLOCK_N = 16, 32
EXTEND_NUM_STAGES = 1
MIN_BLOCK_M = 16  # tl.dot needs >= 16 rows

_LOG2E = 1.4426950408889634


@triton.jit
def _mm_acc(a, b, acc, F32X3: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b``; see :func:`tiles.mm`."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif F32X3:
        return tl.dot(a, b, acc, input_precision="tf32x3")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _key_rows(
    pool_base, slots, pool_stride, new_base, new_rows, new_stride, is_new, offs, mask_n, mask_cols, NEW_KV: tl.constexpr
):
    """A tile of keys (or values): pool rows ``slots``; with ``NEW_KV`` the
    new ones (``is_new``) from the op's rows ``new_rows`` instead."""
    if NEW_KV:
        rows = tl.where(
            is_new[:, None],
            load_rows(new_base, new_rows, new_stride, offs, mask_n & is_new, mask_cols),
            load_rows(pool_base, slots, pool_stride, offs, mask_n & ~is_new, mask_cols),
        )
    else:
        rows = load_rows(pool_base, slots, pool_stride, offs, mask_n, mask_cols)
    return rows


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    mask_ptr,
    mask_indptr_ptr,
    new_k_ptr,
    new_v_ptr,
    loc_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_nkt,
    stride_nkh,
    stride_nvt,
    stride_nvh,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_MASK: tl.constexpr,
    F32X3: tl.constexpr,
    UPCAST: tl.constexpr,
    NEW_KV: tl.constexpr,
):
    # Grid: (bs, num_kv_heads, cdiv(max_q_len * GROUP, BLOCK_M)).
    # NEW_KV: new keys and values come from new_k/new_v (rows q_start + i), and
    # each program writes to the pool those whose token starts in its block:
    # each written once, none read from the pool.
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    row0 = tl.program_id(2) * BLOCK_M
    q_start = tl.load(qo_indptr_ptr + req)
    q_len = tl.load(qo_indptr_ptr + req + 1) - q_start
    if row0 >= q_len * GROUP:
        return
    kv_start = tl.load(kv_indptr_ptr + req)
    kv_len = tl.load(kv_indptr_ptr + req + 1) - kv_start
    prefix = kv_len - q_len

    rows = row0 + tl.arange(0, BLOCK_M)
    mask_m = rows < q_len * GROUP
    tok = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < D
    mask_dv = offs_dv < DV

    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    if USE_MASK:
        key_end = kv_len
        # The request's base offset may pass 2**31 (int64 mask_indptr); offsets
        # within one [q_len, kv_len] block stay int32 to save registers.
        mask_base = mask_ptr + tl.load(mask_indptr_ptr + req)
        mask_row = tok * kv_len
    else:
        # Causal: keys past this block's last token are never visible.
        last_tok = (tl.minimum(row0 + BLOCK_M, q_len * GROUP) - 1) // GROUP
        key_end = tl.minimum(kv_len, prefix + last_tok + 1)

    if NEW_KV:
        first = mask_m & (rows % GROUP == 0)
        new_rows = (q_start + tok).to(tl.int64)
        slot = tl.load(loc_ptr + new_rows, mask=first, other=0).to(tl.int64)
        new_k = load_rows(new_k_ptr + kv_head * stride_nkh, new_rows, stride_nkt, offs_d, first, mask_d)
        tl.store(
            k_ptr + kv_head * stride_kh + slot[:, None] * stride_kt + offs_d[None, :],
            new_k,
            mask=first[:, None] & mask_d[None, :],
        )
        new_v = load_rows(new_v_ptr + kv_head * stride_nvh, new_rows, stride_nvt, offs_dv, first, mask_dv)
        tl.store(
            v_ptr + kv_head * stride_vh + slot[:, None] * stride_vt + offs_dv[None, :],
            new_v,
            mask=first[:, None] & mask_dv[None, :],
        )

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    new_k_base = new_k_ptr + kv_head * stride_nkh
    new_v_base = new_v_ptr + kv_head * stride_nvh
    for n0 in range(0, key_end, BLOCK_N):
        keys = n0 + offs_n
        mask_n = keys < key_end
        # int64: slot * row stride can pass 2**31 in a large pool.
        slots = tl.load(kv_indices_ptr + kv_start + keys, mask=mask_n, other=0).to(tl.int64)
        is_new = keys >= prefix  # with NEW_KV: rows q_start + key - prefix of new_k/new_v
        new_keys = (q_start + keys - prefix).to(tl.int64)
        k = _key_rows(
            k_base, slots, stride_kt, new_k_base, new_keys, stride_nkt, is_new, offs_d, mask_n, mask_d, NEW_KV
        )
        # Logits in the exp2 domain (qk_scale = sm_scale * log2(e)).
        if USE_MASK:
            visible = (
                tl.load(
                    mask_base + mask_row[:, None] + keys[None, :],
                    mask=mask_m[:, None] & mask_n[None, :],
                    other=0,
                )
                != 0
            )
            # The mask enters as the dot's -inf/0 accumulator: masking after
            # the dot spills on sm_90 (two register layouts).
            bias = tl.where(visible, 0.0, float("-inf"))
            s = _mm_acc(q, tl.trans(k), bias, F32X3, UPCAST) * qk_scale
        else:
            s = mm(q, tl.trans(k), F32X3, UPCAST) * qk_scale
            visible = keys[None, :] <= (prefix + tok)[:, None]
            s = tl.where(visible & mask_n[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        v = _key_rows(
            v_base, slots, stride_vt, new_v_base, new_keys, stride_nvt, is_new, offs_dv, mask_n, mask_dv, NEW_KV
        )
        acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, F32X3, UPCAST)

    # l_i == 0: no key carried weight, so zeros, not 0/0. Not `l_i > 0`: a NaN
    # l_i fails that too, and NaN must reach the output (see softmax_step).
    result = tl.where(l_i[:, None] == 0, 0.0, acc / l_i[:, None])
    tl.store(
        out_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_dv[None, :],
    )


# TRITON_INTERPRET=1: bf16 dots need UPCAST (see tiles.mm).
_INTERPRETED = not runs_compiled(_extend_kernel)


@functools.lru_cache(maxsize=256)
def extend_kernel_meta(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dv: int,
    dtype: torch.dtype,
    max_q_len: int,
    use_mask: bool,
    new_kv: bool = False,
) -> dict:
    """The kernel's compile-time arguments (shared by the launcher and the
    sm_90 compile test); short queries get a smaller row tile. Cached:
    callers only unpack the dict."""
    group = num_q_heads // num_kv_heads
    padded = triton.next_power_of_2(max(head_dim, dv))
    block_m, block_n = _tiles(dtype == torch.float32, padded)
    block_m = min(block_m, max(MIN_BLOCK_M, triton.next_power_of_2(max_q_len * group)))
    return dict(
        GROUP=group,
        D=head_dim,
        DV=dv,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(dv),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_MASK=use_mask,
        F32X3=dtype == torch.float32,
        UPCAST=_INTERPRETED and dtype == torch.bfloat16,
        NEW_KV=new_kv,
        num_warps=_num_warps(padded, block_m),
        num_stages=EXTEND_NUM_STAGES,
    )


def _tiles(fp32: bool, padded_head: int) -> tuple:
    """The largest (row, key) tile for fp32 or 16-bit inputs and this padded head size."""
    if fp32:
        return FP32_BLOCK_M, FP32_BLOCK_N
    if padded_head <= 128:
        return EXTEND_BLOCK_M, EXTEND_BLOCK_N
    return LARGE_HEAD_BLOCK_M, LARGE_HEAD_BLOCK_N


def _num_warps(padded_head: int, block_m: int) -> int:
    return 4 if padded_head <= 64 or block_m < 64 else 8


def row_tile_variants(meta: dict) -> list:
    """``meta`` with each other row tile a query length can take, for the
    launcher to compile ahead rather than one by one during capture."""
    padded = max(meta["BLOCK_D"], meta["BLOCK_DV"])
    largest = _tiles(meta["F32X3"], padded)[0]  # F32X3: fp32 inputs
    variants, block_m = [], MIN_BLOCK_M
    while block_m <= largest:
        if block_m != meta["BLOCK_M"]:
            variants.append({**meta, "BLOCK_M": block_m, "num_warps": _num_warps(padded, block_m)})
        block_m *= 2
    return variants


_launch_extend = FastLauncher(_extend_kernel, variants=row_tile_variants)


def _check_extend_args(q, k_cache, v_cache, out, custom_mask, mask_indptr) -> None:
    """Shape/dtype/layout checks that read no tensor values (no sync)."""
    check_attention_args("extend_attention", "T", q, k_cache, v_cache, out)
    if (custom_mask is None) != (mask_indptr is None):
        raise InvalidInputError(
            "extend_attention: expected custom_mask and mask_indptr together, got only one; pass both or neither"
        )
    if custom_mask is not None and (custom_mask.dim() != 1 or custom_mask.dtype not in (torch.bool, torch.uint8)):
        raise InvalidInputError(
            f"extend_attention: expected a flat bool/uint8 custom_mask, "
            f"got {custom_mask.dtype} {list(custom_mask.shape)}"
        )
    check_last_dim_contiguous("extend_attention", q=q, k_cache=k_cache, v_cache=v_cache, out=out)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    max_q_len: int,
    sm_scale: float,
    custom_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
) -> None:
    """Attention of each request's new tokens (rows ``qo_indptr[r]:qo_indptr[r
    + 1]`` of ``q``) over its keys (prefix, then new; already in the pool);
    writes ``out``. ``max_q_len``: a static bound that sets the grid; rows
    beyond it are not computed. ``custom_mask``: flat, request r's row-major
    ``[q_len, kv_len]`` block at ``mask_indptr[r]``; replaces the causal rule.
    """
    _check_extend_args(q, k_cache, v_cache, out, custom_mask, mask_indptr)
    launch = _extend_launch(
        q, k_cache, v_cache, out, qo_indptr, kv_indptr, kv_indices, max_q_len, sm_scale, custom_mask, mask_indptr
    )
    if launch is not None:
        launch.launch(q, k_cache, v_cache, out)


def _extend_launch(
    q,
    k_cache,
    v_cache,
    out,
    qo_indptr,
    kv_indptr,
    kv_indices,
    max_q_len,
    sm_scale,
    custom_mask,
    mask_indptr,
    new_kv: Optional[tuple] = None,
) -> Optional[StepLaunch]:
    """The kernel's launch for these checked tensors (None: nothing to do).
    ``new_kv``: (new_k, new_v, out_cache_loc), written by the kernel itself."""
    bs = qo_indptr.shape[0] - 1
    if bs <= 0 or max_q_len <= 0 or q.shape[0] == 0:
        return None
    grid, args, meta = _extend_args(
        q,
        k_cache,
        v_cache,
        out,
        qo_indptr,
        kv_indptr,
        kv_indices,
        max_q_len,
        sm_scale,
        custom_mask,
        mask_indptr,
        new_kv,
    )
    layer_positions = (0, 1, 2, 3, 9, 10) if new_kv is not None else (0, 1, 2, 3)
    return StepLaunch(_launch_extend, grid, args, meta, layer_positions=layer_positions)


def _extend_args(
    q,
    k_cache,
    v_cache,
    out,
    qo_indptr,
    kv_indptr,
    kv_indices,
    max_q_len,
    sm_scale,
    custom_mask,
    mask_indptr,
    new_kv: Optional[tuple],
) -> Tuple[tuple, tuple, dict]:
    """The kernel's grid, runtime arguments and constexprs, from shapes, strides and dtypes alone."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, dv = k_cache.shape[1], v_cache.shape[2]
    bs = qo_indptr.shape[0] - 1
    meta = extend_kernel_meta(
        num_q_heads, num_kv_heads, head_dim, dv, q.dtype, max_q_len, custom_mask is not None, new_kv is not None
    )
    grid = (bs, num_kv_heads, triton.cdiv(max_q_len * meta["GROUP"], meta["BLOCK_M"]))
    # Unused pointers get a step's tensor, never a layer's (a plan outlives its first layer).
    new_k, new_v, loc = new_kv if new_kv is not None else (kv_indptr, kv_indptr, kv_indptr)
    new_strides = (new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1)) if new_kv else (0, 0, 0, 0)
    args = (
        q, k_cache, v_cache, out, qo_indptr, kv_indptr, kv_indices,
        kv_indptr if custom_mask is None else custom_mask,
        kv_indptr if mask_indptr is None else mask_indptr,
        new_k, new_v, loc,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), *new_strides,
    )  # fmt: skip
    return grid, args, meta


class ExtendPlan:
    """An extend step's launches for every layer, fixed at the first: a K/V
    store (zeroing padded output rows), then the attention. With
    ``fuse_kv_write`` and no padded rows, one launch: the attention writes the
    K/V itself, which needs each request's new tokens to be its last ``q_len``
    keys, in order. Args as :func:`extend_attention`, plus the new tokens'
    ``new_k, new_v``, their slots ``out_cache_loc``, and ``num_rows``.
    """

    def __init__(
        self,
        q,
        k_cache,
        v_cache,
        out,
        qo_indptr,
        kv_indptr,
        kv_indices,
        max_q_len,
        sm_scale,
        custom_mask=None,
        mask_indptr=None,
        *,
        new_k,
        new_v,
        out_cache_loc,
        num_rows,
        fuse_kv_write: bool = False,
    ):
        _check_extend_args(q, k_cache, v_cache, out, custom_mask, mask_indptr)
        rows = q.shape[0]
        num_rows = check_num_rows("extend_attention", rows, num_rows)
        if new_k is None or new_v is None or out_cache_loc is None:
            raise InvalidInputError("extend_attention: expected new_k, new_v and out_cache_loc for a plan, got None")
        check_new_kv("extend_attention", rows, num_rows, k_cache, v_cache, new_k, new_v, out_cache_loc)
        check_last_dim_contiguous("extend_attention", new_k=new_k, new_v=new_v)
        self._layout = layer_layout(q, k_cache, v_cache, out, new_k, new_v)
        self._slots, self._num_rows = out_cache_loc, num_rows
        self._fused = fuse_kv_write and custom_mask is None and num_rows == rows
        self._store = None
        if not self._fused and rows:
            meta = store_kv_meta(k_cache.shape[1], q.shape[1], k_cache.shape[2], v_cache.shape[2])
            args = store_kv_args(new_k, new_v, k_cache, v_cache, out_cache_loc, out, num_rows)
            self._store = StepLaunch(launch_store_kv, (rows,), args, meta, layer_positions=(0, 1, 2, 3, 5))
        new_kv = (new_k, new_v, out_cache_loc) if self._fused else None
        self._attend = (
            _extend_launch(
                q,
                k_cache,
                v_cache,
                out,
                qo_indptr,
                kv_indptr,
                kv_indices,
                max_q_len,
                sm_scale,
                custom_mask,
                mask_indptr,
                new_kv,
            )
            if num_rows
            else None
        )

    def launch(self, q, k_cache, v_cache, out, new_k, new_v, layer=None) -> bool:
        """One layer's K/V write and attention; False, launching nothing, when
        its tensors are laid out unlike the first layer's."""
        if layer is not None and self._launch_again(layer, q, k_cache, v_cache, out, new_k, new_v):
            return True
        if layer_layout(q, k_cache, v_cache, out, new_k, new_v) != self._layout:
            return False
        if self._store is not None:
            self._store.launch(new_k, new_v, k_cache, v_cache, out, layer=layer)
        if self._attend is not None:
            self._attend.launch(*self._attend_tensors(q, k_cache, v_cache, out, new_k, new_v), layer=layer)
        return True

    def rebind_slots(self, out_cache_loc: torch.Tensor) -> bool:
        """Take the next step's new-token slots, the rest unchanged; False where it cannot."""
        launches = [(self._store, _STORE_SLOTS_ARG)] if self._store is not None else []
        if self._fused and self._attend is not None:
            launches.append((self._attend, _EXTEND_SLOTS_ARG))
        if not rebind_slots("extend_attention", self._slots, out_cache_loc, self._num_rows, launches):
            return False
        self._slots = out_cache_loc
        return True

    def _attend_tensors(self, q, k_cache, v_cache, out, new_k, new_v) -> tuple:
        return (q, k_cache, v_cache, out, new_k, new_v) if self._fused else (q, k_cache, v_cache, out)

    def _launch_again(self, layer, q, k_cache, v_cache, out, new_k, new_v) -> bool:
        """Both launches of ``layer`` as its last step's, or neither."""
        store, attend = self._store, self._attend
        if store is None and attend is None:
            return False
        store_kept = attend_kept = None
        if store is not None:
            store_kept = store.kept_launch(layer, (new_k, new_v, k_cache, v_cache, out))
            if store_kept is None:
                return False
        if attend is not None:
            attend_kept = attend.kept_launch(layer, self._attend_tensors(q, k_cache, v_cache, out, new_k, new_v))
            if attend_kept is None:
                return False
        if store is not None:
            store.launch_kept(store_kept)
        if attend is not None:
            attend.launch_kept(attend_kept)
        return True


# The new tokens' slots among the store kernel's and the fused kernel's arguments.
_STORE_SLOTS_ARG = 4
_EXTEND_SLOTS_ARG = 11
