"""The Triton kernels behind ``ops/projections.py``: ``y = x @ W.T`` for at
most :data:`MAX_ROWS` rows, where streaming ``W`` once is the whole cost, with
the RMSNorm of ``x`` fused before (``NORM``: the product of ``x *
norm_weight`` scaled by each row's ``rsqrt(mean(x**2) + eps)``) and one
epilogue after (bias and residual, rotary, or SiLU·mul).

Each program computes ``BLOCK_N`` columns for every row; with ``SPLIT_K > 1``
programs store float32 partials and the last to arrive adds them in split
order (deterministic) and runs the epilogue.
"""

from __future__ import annotations

from typing import Optional

import torch

from sgl_piecewise.internals import pdl
from sgl_piecewise.internals.triton_jit import runs_compiled
from sgl_piecewise.ops.kernels.tilings import Tiling, rotary_kind, tiling_for

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - the ops take their plain formulas without Triton
    triton = None

MAX_ROWS = 64  # rows one launch serves; more go to cuBLAS


if triton is not None:

    @triton.jit
    def _x_chunk(x_ptr, nw_ptr, offs_m, mask_m, offs_k, mask_k, stride_xm, NORM: tl.constexpr, EVEN_K: tl.constexpr):
        """A ``[BLOCK_M, BLOCK_K]`` chunk of ``x`` (times the norm weight) and its rows' sum of squares."""
        rows = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        if EVEN_K:
            x = tl.load(rows, mask=mask_m[:, None], other=0.0)
        else:
            x = tl.load(rows, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        squares = tl.zeros([x.shape[0]], dtype=tl.float32)
        if NORM:
            xf = x.to(tl.float32)
            squares = tl.sum(xf * xf, axis=1)
            if EVEN_K:
                nw = tl.load(nw_ptr + offs_k).to(tl.float32)
            else:
                nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            x = (xf * nw[None, :]).to(x.dtype)
        return x, squares

    @triton.jit
    def _w_chunk(rows, offs_k, mask_n, mask_k, EVEN_K: tl.constexpr):
        """A ``[BLOCK_N, BLOCK_K]`` chunk of weight rows (``rows``: their starts)."""
        if EVEN_K:
            w = tl.load(rows + offs_k[None, :], mask=mask_n[:, None], other=0.0)
        else:
            w = tl.load(rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        return w

    @triton.jit
    def _k_offsets(k0, hi, BLOCK_K: tl.constexpr):
        """The chunk's columns (contiguous from a multiple of BLOCK_K: 16-byte
        loads) and their mask against the split's end ``hi``."""
        offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        return offs_k, offs_k < hi

    @triton.jit
    def _acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """``[BLOCK_M, BLOCK_N]`` for the dot; for one row ``[BLOCK_N, BLOCK_K]``, summed after the loop."""
        if BLOCK_M == 1:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        return acc

    @triton.jit
    def _mac(x, w, acc, F32X3: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr):
        """``acc + x @ w.T`` in float32: one row on the CUDA cores, more on the
        tensor cores (F32X3, UPCAST: as ``tiles.mm``)."""
        if BLOCK_M == 1:
            acc = acc + w.to(tl.float32) * x.to(tl.float32)
        elif UPCAST:
            acc = acc + tl.dot(x.to(tl.float32), tl.trans(w).to(tl.float32))
        elif F32X3:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="tf32x3")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        return acc

    @triton.jit
    def _acc_done(acc, BLOCK_M: tl.constexpr):
        """The accumulator as ``[BLOCK_M, BLOCK_N]`` sums."""
        if BLOCK_M == 1:
            acc = tl.sum(acc, axis=1)[None, :]
        return acc

    @triton.jit
    def _chain_wait(PDL: tl.constexpr):
        """Wait for the previous kernel's writes before touching shared memory."""
        if PDL:
            pdl.gdc_wait()

    @triton.jit
    def _chain_release(PDL: tl.constexpr):
        """Let the next kernel be scheduled (once every program of this one has
        started) so that its programs load their first weight chunk while this
        one's last programs run."""
        if PDL:
            pdl.gdc_launch_dependents()

    @triton.jit
    def _k_range(K, split, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
        per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        lo = split * per_split
        return lo, tl.minimum(lo + per_split, K)

    @triton.jit
    def _row_scale(squares, K, eps, NORM: tl.constexpr, LIBDEVICE: tl.constexpr):
        """Each row's RMSNorm factor (1 without ``NORM``); CUDA's rsqrtf, as torch.rsqrt."""
        scale = tl.full(squares.shape, 1.0, tl.float32)
        if NORM:
            if LIBDEVICE:
                scale = libdevice.rsqrt(squares / K + eps)
            else:
                scale = tl.math.rsqrt(squares / K + eps)
        return scale

    @triton.jit
    def _arrive_last(
        part_ptr,
        count_ptr,
        tile,
        acc,
        squares,
        offs_m,
        offs_n,
        split,
        NUM_ACC: tl.constexpr,
        ACC_ID: tl.constexpr,
        SPLIT_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Store this split's partials of accumulator ``ACC_ID`` at ``[split,
        tile, acc, BLOCK_M, BLOCK_N + 1]`` (last column: the rows' sums of squares)."""
        row = BLOCK_N + 1
        base = part_ptr + ((split * tl.num_programs(0) + tile) * NUM_ACC + ACC_ID) * (BLOCK_M * row)
        tl.store(base + offs_m[:, None] * row + offs_n[None, :], acc)
        tl.store(base + offs_m * row + BLOCK_N, squares)

    @triton.jit
    def _merged(
        part_ptr,
        tile,
        offs_m,
        offs_n,
        NUM_ACC: tl.constexpr,
        ACC_ID: tl.constexpr,
        SPLIT_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Every split's partials added in split order; loads bypass L1 (written during this launch)."""
        row = BLOCK_N + 1
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            base = part_ptr + ((s * tl.num_programs(0) + tile) * NUM_ACC + ACC_ID) * (BLOCK_M * row)
            acc += tl.load(base + offs_m[:, None] * row + offs_n[None, :], cache_modifier=".cg")
            squares += tl.load(base + offs_m * row + BLOCK_N, cache_modifier=".cg")
        return acc, squares

    @triton.jit
    def _count_arrival(count_ptr, tile, SPLIT_K: tl.constexpr):
        """Is this the tile's last split to arrive (partials stored before the
        acq_rel increment)? The last resets the count."""
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        last = arrived == SPLIT_K - 1
        if last:
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
        return last

    @triton.jit
    def _linear_kernel(
        x_ptr,
        nw_ptr,
        w_ptr,
        bias_ptr,
        res_ptr,
        out_ptr,
        part_ptr,
        count_ptr,
        M,
        N,
        K,
        eps,
        stride_xm,
        stride_wn,
        stride_rm,
        stride_om,
        NORM: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        RESIDUAL: tl.constexpr,
        EVEN_K: tl.constexpr,
        F32X3: tl.constexpr,
        UPCAST: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        PDL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):
        # Grid: (cdiv(N, BLOCK_N), SPLIT_K). W's rows are int64-addressed (a
        # vocabulary times the hidden size can pass 2**31 elements).
        tile = tl.program_id(0)
        split = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m, mask_n = offs_m < M, offs_n < N
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
        _chain_release(PDL)
        lo, hi = _k_range(K, split, SPLIT_K, BLOCK_K)
        # The first chunk's weights before the wait: no kernel of the chain writes them.
        offs_k, mask_k = _k_offsets(lo, hi, BLOCK_K)
        w = _w_chunk(w_rows, offs_k, mask_n, mask_k, EVEN_K)
        _chain_wait(PDL)
        x, squares = _x_chunk(x_ptr, nw_ptr, offs_m, mask_m, offs_k, mask_k, stride_xm, NORM, EVEN_K)
        acc = _mac(x, w, _acc_zeros(BLOCK_M, BLOCK_N, BLOCK_K), F32X3, UPCAST, BLOCK_M)
        for k0 in range(lo + BLOCK_K, hi, BLOCK_K):
            offs_k, mask_k = _k_offsets(k0, hi, BLOCK_K)
            x, sq = _x_chunk(x_ptr, nw_ptr, offs_m, mask_m, offs_k, mask_k, stride_xm, NORM, EVEN_K)
            w = _w_chunk(w_rows, offs_k, mask_n, mask_k, EVEN_K)
            acc = _mac(x, w, acc, F32X3, UPCAST, BLOCK_M)
            squares += sq
        acc = _acc_done(acc, BLOCK_M)
        last = True
        if SPLIT_K > 1:
            _arrive_last(
                part_ptr,
                count_ptr,
                tile,
                acc,
                squares,
                tl.arange(0, BLOCK_M),
                tl.arange(0, BLOCK_N),
                split,
                1,
                0,
                SPLIT_K,
                BLOCK_M,
                BLOCK_N,
            )
            last = _count_arrival(count_ptr, tile, SPLIT_K)
        if last:
            if SPLIT_K > 1:
                acc, squares = _merged(
                    part_ptr, tile, tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), 1, 0, SPLIT_K, BLOCK_M, BLOCK_N
                )
            y = acc * _row_scale(squares, K, eps, NORM, LIBDEVICE)[:, None]
            if HAS_BIAS:
                y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            y = y.to(out_ptr.dtype.element_ty)
            mask = mask_m[:, None] & mask_n[None, :]
            if RESIDUAL:  # x + linear(...), each rounded as the two ops round
                r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
                y = (r.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=mask)

    @triton.jit
    def _paired_kernel(
        x_ptr,
        nw_ptr,
        w_ptr,
        bias_ptr,
        out_ptr,
        out2_ptr,
        pos_ptr,
        cs_ptr,
        part_ptr,
        count_ptr,
        M,
        K,
        HALF_ROWS,
        eps,
        stride_xm,
        stride_wn,
        stride_om,
        stride_oh,
        stride_o2m,
        stride_o2h,
        stride_cs,
        HEAD_DIM: tl.constexpr,
        ROTATED_HEADS: tl.constexpr,
        ROTARY: tl.constexpr,
        NORM: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        F32X3: tl.constexpr,
        UPCAST: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        PDL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):
        # Each program takes two row blocks of W, a and b, and combines the
        # two products column by column. Not ROTARY: a = gate rows
        # [c, c + BLOCK_N), b = the up rows HALF_ROWS further (HALF_ROWS = F).
        # ROTARY: per head of HEAD_DIM rows, a = the first half's
        # columns, b = the second half's (HALF_ROWS = HEAD_DIM // 2); heads
        # below ROTATED_HEADS (q and k) are rotated into out, the rest (v)
        # copied into out2.
        tile = tl.program_id(0)
        split = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        if ROTARY:
            per_head = (HEAD_DIM // 2 + BLOCK_N - 1) // BLOCK_N
            head = tile // per_head
            within = (tile % per_head) * BLOCK_N + cols  # column within the half head
            rows_a = head * HEAD_DIM + within
        else:
            within = tile * BLOCK_N + cols  # output column
            rows_a = within
        mask_n = within < HALF_ROWS
        a_rows = w_ptr + rows_a.to(tl.int64)[:, None] * stride_wn
        b_rows = a_rows + HALF_ROWS * stride_wn
        _chain_release(PDL)
        lo, hi = _k_range(K, split, SPLIT_K, BLOCK_K)
        offs_k, mask_k = _k_offsets(lo, hi, BLOCK_K)
        wa = _w_chunk(a_rows, offs_k, mask_n, mask_k, EVEN_K)
        wb = _w_chunk(b_rows, offs_k, mask_n, mask_k, EVEN_K)
        _chain_wait(PDL)
        x, squares = _x_chunk(x_ptr, nw_ptr, offs_m, mask_m, offs_k, mask_k, stride_xm, NORM, EVEN_K)
        acc_a = _mac(x, wa, _acc_zeros(BLOCK_M, BLOCK_N, BLOCK_K), F32X3, UPCAST, BLOCK_M)
        acc_b = _mac(x, wb, _acc_zeros(BLOCK_M, BLOCK_N, BLOCK_K), F32X3, UPCAST, BLOCK_M)
        for k0 in range(lo + BLOCK_K, hi, BLOCK_K):
            offs_k, mask_k = _k_offsets(k0, hi, BLOCK_K)
            x, sq = _x_chunk(x_ptr, nw_ptr, offs_m, mask_m, offs_k, mask_k, stride_xm, NORM, EVEN_K)
            wa = _w_chunk(a_rows, offs_k, mask_n, mask_k, EVEN_K)
            wb = _w_chunk(b_rows, offs_k, mask_n, mask_k, EVEN_K)
            acc_a = _mac(x, wa, acc_a, F32X3, UPCAST, BLOCK_M)
            acc_b = _mac(x, wb, acc_b, F32X3, UPCAST, BLOCK_M)
            squares += sq
        acc_a, acc_b = _acc_done(acc_a, BLOCK_M), _acc_done(acc_b, BLOCK_M)
        last = True
        if SPLIT_K > 1:
            _arrive_last(
                part_ptr, count_ptr, tile, acc_a, squares, offs_m, cols, split, 2, 0, SPLIT_K, BLOCK_M, BLOCK_N
            )
            _arrive_last(
                part_ptr, count_ptr, tile, acc_b, squares, offs_m, cols, split, 2, 1, SPLIT_K, BLOCK_M, BLOCK_N
            )
            last = _count_arrival(count_ptr, tile, SPLIT_K)
        if last:
            if SPLIT_K > 1:
                acc_a, squares = _merged(part_ptr, tile, offs_m, cols, 2, 0, SPLIT_K, BLOCK_M, BLOCK_N)
                acc_b, squares = _merged(part_ptr, tile, offs_m, cols, 2, 1, SPLIT_K, BLOCK_M, BLOCK_N)
            scale = _row_scale(squares, K, eps, NORM, LIBDEVICE)[:, None]
            a, b = acc_a * scale, acc_b * scale
            if HAS_BIAS:
                a += tl.load(bias_ptr + rows_a, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                b += tl.load(bias_ptr + rows_a + HALF_ROWS, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            dt = out_ptr.dtype.element_ty
            a, b = a.to(dt), b.to(dt)
            mask = mask_m[:, None] & mask_n[None, :]
            if not ROTARY:
                silu = _silu_mul(a, b, LIBDEVICE)
                tl.store(out_ptr + offs_m[:, None] * stride_om + within[None, :], silu, mask=mask)
            elif head < ROTATED_HEADS:
                pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
                cs = cs_ptr + pos[:, None] * stride_cs + within[None, :]
                cos = tl.load(cs, mask=mask, other=0.0)
                sin = tl.load(cs + HALF_ROWS, mask=mask, other=0.0)
                first, second = _rotate(a, b, cos, sin)
                dst = out_ptr + offs_m[:, None] * stride_om + head * stride_oh + within[None, :]
                tl.store(dst, first, mask=mask)
                tl.store(dst + HALF_ROWS, second, mask=mask)
            else:
                dst = out2_ptr + offs_m[:, None] * stride_o2m + (head - ROTATED_HEADS) * stride_o2h + within[None, :]
                tl.store(dst, a, mask=mask)
                tl.store(dst + HALF_ROWS, b, mask=mask)

    @triton.jit
    def _silu_mul(gate, up, LIBDEVICE: tl.constexpr):
        """``silu(gate) * up``, each op rounded to the dtype as torch's two ops round."""
        g = gate.to(tl.float32)
        if LIBDEVICE:  # CUDA's expf and IEEE division, as F.silu
            silu = libdevice.div_rn(g, 1.0 + libdevice.exp(-g)).to(gate.dtype)
        else:
            silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)

    @triton.jit
    def _rotate(x1, x2, cos, sin):
        """``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``, each product rounded
        to the dtype as its own op, as the plain formula rounds."""
        dt = x1.dtype
        cf, sf, x1f, x2f = cos.to(tl.float32), sin.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32)
        first = ((x1f * cf).to(dt).to(tl.float32) - (x2f * sf).to(dt).to(tl.float32)).to(dt)
        second = ((x2f * cf).to(dt).to(tl.float32) + (x1f * sf).to(dt).to(tl.float32)).to(dt)
        return first, second

    # Under TRITON_INTERPRET=1: no libdevice.
    _LIBDEVICE = runs_compiled(_linear_kernel)
else:  # pragma: no cover
    _LIBDEVICE = False


# Split arrival counts per device, left zero by every launch; never freed (captured
# launches keep their address), and a capture that finds none launches unsplit.
MAX_SPLIT_TILES = 4096
_counters: dict = {}


def _split_counters(device: torch.device) -> Optional[torch.Tensor]:
    key = (device.type, device.index)
    counts = _counters.get(key)
    if counts is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        counts = _counters[key] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return counts


def _split(tiling: Tiling, tiles: int, rows_blk: int, num_acc: int, device: torch.device) -> tuple:
    """(split_k, partials scratch, counts) of a launch of ``tiles`` programs per split."""
    counts = _split_counters(device) if tiling.split_k > 1 and tiles <= MAX_SPLIT_TILES else None
    if counts is None:
        return 1, None, None
    part = torch.empty(
        tiling.split_k * tiles * num_acc * rows_blk * (tiling.block_n + 1), dtype=torch.float32, device=device
    )
    return tiling.split_k, part, counts


def kernel_meta(tiling: Tiling, rows: int, k: int, split_k: int, dtype: torch.dtype, chained: bool, **epilogue) -> dict:
    """A launch's compile-time arguments (shared by the launchers and the sm_90 compile test)."""
    return dict(
        epilogue,
        EVEN_K=k % (tiling.block_k * split_k) == 0,
        F32X3=dtype == torch.float32,
        UPCAST=not _LIBDEVICE and dtype == torch.bfloat16,  # the interpreter's dot
        LIBDEVICE=_LIBDEVICE,
        PDL=chained,
        BLOCK_M=tiling.block_m(rows),
        BLOCK_N=tiling.block_n,
        BLOCK_K=tiling.block_k,
        SPLIT_K=split_k,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )


def _launch(kernel, grid, args, meta) -> None:
    if meta["PDL"]:
        meta = dict(meta, launch_pdl=True)
    kernel[grid](*args, **meta)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
    norm_weight: Optional[torch.Tensor] = None,
    eps: float = 0.0,
    out_dtype: Optional[torch.dtype] = None,
    tiling: Optional[Tiling] = None,
) -> torch.Tensor:
    """``[residual +] (rms_norm(x) | x) @ weight.T [+ bias]`` for ``x [M <= MAX_ROWS, K]``;
    arguments checked by the caller (unit last strides, one dtype and device)."""
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=out_dtype or x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    tiling = tiling or tiling_for("linear", rows, n, k, x.device)
    block_m, tiles = tiling.block_m(rows), triton.cdiv(n, tiling.block_n)
    split_k, part, counts = _split(tiling, tiles, block_m, 1, x.device)
    res = residual if residual is not None else out
    args = (
        x,
        norm_weight if norm_weight is not None else x,
        weight,
        bias if bias is not None else x,
        res,
        out,
        part if part is not None else out,
        counts if counts is not None else out,
        rows,
        n,
        k,
        eps,
        x.stride(0),
        weight.stride(0),
        res.stride(0),
        out.stride(0),
    )
    epilogue = dict(NORM=norm_weight is not None, HAS_BIAS=bias is not None, RESIDUAL=residual is not None)
    meta = kernel_meta(tiling, rows, k, split_k, x.dtype, pdl.enabled(x.device), **epilogue)
    _launch(_linear_kernel, (tiles, split_k), args, meta)
    return out


def _paired(
    x, weight, bias, norm_weight, eps, tiling, half_rows, tiles_of, out, out2, positions, cos_sin, rotary: dict
) -> None:
    rows, k = x.shape
    tiles = tiles_of(tiling.block_n)
    block_m = tiling.block_m(rows)
    split_k, part, counts = _split(tiling, tiles, block_m, 2, x.device)
    args = (
        x,
        norm_weight if norm_weight is not None else x,
        weight,
        bias if bias is not None else x,
        out,
        out2 if out2 is not None else out,
        positions if positions is not None else x,
        cos_sin if cos_sin is not None else x,
        part if part is not None else out,
        counts if counts is not None else out,
        rows,
        k,
        half_rows,
        eps,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        out.stride(1) if out.dim() == 3 else 0,
        out2.stride(0) if out2 is not None else 0,
        out2.stride(1) if out2 is not None else 0,
        cos_sin.stride(0) if cos_sin is not None else 0,
    )
    epilogue = dict(
        HEAD_DIM=rotary.get("head_dim", 0),
        ROTATED_HEADS=rotary.get("rotated", 0),
        ROTARY=bool(rotary),
        NORM=norm_weight is not None,
        HAS_BIAS=bias is not None,
    )
    meta = kernel_meta(tiling, rows, k, split_k, x.dtype, pdl.enabled(x.device), **epilogue)
    _launch(_paired_kernel, (tiles, split_k), args, meta)


def gate_up_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: Optional[torch.Tensor] = None,
    eps: float = 0.0,
    tiling: Optional[Tiling] = None,
) -> torch.Tensor:
    """``silu(g) * u`` with ``[g, u] = (rms_norm(x) | x) @ weight.T``, weight ``[2F, K]`` gate rows then up rows."""
    rows, k = x.shape
    f = weight.shape[0] // 2
    out = torch.empty((rows, f), dtype=x.dtype, device=x.device)
    if rows and f:
        tiling = tiling or tiling_for("silu", rows, f, k, x.device)
        _paired(x, weight, None, norm_weight, eps, tiling, f, lambda bn: triton.cdiv(f, bn), out, None, None, None, {})
    return out


def qkv_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    norm_weight: Optional[torch.Tensor] = None,
    eps: float = 0.0,
    tiling: Optional[Tiling] = None,
) -> tuple:
    """``(qk rotated by positions, v)`` of ``(rms_norm(x) | x) @ weight.T + bias``."""
    rows, k = x.shape
    rotated = num_heads + num_kv_heads
    qk = torch.empty((rows, rotated, head_dim), dtype=x.dtype, device=x.device)
    v = torch.empty((rows, num_kv_heads, head_dim), dtype=x.dtype, device=x.device)
    if rows:
        half = head_dim // 2
        heads = rotated + num_kv_heads
        tiling = tiling or tiling_for(rotary_kind(head_dim), rows, heads * half, k, x.device)
        tiles_of = lambda bn: heads * triton.cdiv(half, bn)  # noqa: E731
        _paired(
            x,
            weight,
            bias,
            norm_weight,
            eps,
            tiling,
            half,
            tiles_of,
            qk,
            v,
            positions,
            cos_sin_cache,
            dict(head_dim=head_dim, rotated=rotated),
        )
    return qk, v
