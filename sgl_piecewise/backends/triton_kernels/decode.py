"""Split-KV ("flash-decoding") attention, one query token per request, in one
launch: one program per (request, kv head, split) attends all query heads of
its kv head, so K/V rows are read once per kv head; the split that finishes
last merges the partials. Optionally the launch writes the new tokens' K/V.

The grid depends only on ``bs``, head counts and ``max_kv_splits`` (split
counts are read on the device), so one captured launch serves every replay.
Only the request's own ``kv_indices`` are loaded; a row whose keys all weigh
0 gets zeros, as SDPA gives.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

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
from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.internals import pdl
from sgl_piecewise.internals.triton_jit import runs_compiled
from sgl_piecewise.internals.triton_launch import FastLauncher, StepLaunch

# Launch settings: measured by `benchmarks/bench_decode_kernel.py --sweep` (docs/BENCHMARKS.md).
DECODE_BLOCK_H = 16  # query heads per program; tl.dot needs >= 16 rows
DECODE_MAX_BLOCK_H = 64  # wider groups (MQA-like) widen the head tile up to this, without spills
SPLIT_GRANULE = 32  # split boundaries are multiples of this: whole 32-key tiles
DEFAULT_TOKENS_PER_SPLIT = 64  # choose_num_kv_splits: one split per this many keys
DEFAULT_MAX_KV_SPLITS = 64  # a suggested scratch size; grid_kv_splits caps it by the batch
MERGE_CHUNK_VALUES = 8192  # fp32 partials the merge loads at once (merge_block_s)


@dataclass(frozen=True)
class DecodeLaunch:
    """How the split kernel is launched; speed depends on it, results do not."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: Optional[int] = None  # grid_kv_splits' cap; None: default_programs_per_sm
    cap_splits: bool = True  # False: the split axis is always max_kv_splits
    merge_splits: Optional[int] = None  # a power of two; None: merge_block_s

    def __post_init__(self) -> None:
        pow2 = lambda n: isinstance(n, int) and n > 0 and n & (n - 1) == 0  # noqa: E731
        if not (pow2(self.block_n) and self.block_n >= 16 and pow2(self.num_warps)):
            raise InvalidInputError(
                f"DecodeLaunch: expected block_n a power of two >= 16 (tl.dot's minimum) and "
                f"num_warps a power of two, got block_n={self.block_n!r}, num_warps={self.num_warps!r}"
            )
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise InvalidInputError(f"DecodeLaunch: expected num_stages >= 1, got {self.num_stages!r}")
        if self.programs_per_sm is not None:
            check_positive_int("DecodeLaunch.programs_per_sm", self.programs_per_sm)
        if not isinstance(self.cap_splits, bool):
            raise InvalidInputError(f"DecodeLaunch: expected cap_splits a bool, got {self.cap_splits!r}")
        if self.merge_splits is not None and not pow2(self.merge_splits):
            raise InvalidInputError(f"DecodeLaunch: expected merge_splits a power of two, got {self.merge_splits!r}")


DEFAULT_DECODE_LAUNCH = DecodeLaunch()
# fp32: 3xTF32 dots hold more registers; a 64-key tile spills on sm_90.
FP32_DECODE_LAUNCH = DecodeLaunch(block_n=32, num_warps=4, num_stages=2)


def default_decode_launch(dtype: torch.dtype) -> DecodeLaunch:
    return FP32_DECODE_LAUNCH if dtype == torch.float32 else DEFAULT_DECODE_LAUNCH


_LOG2E = 1.4426950408889634


@triton.jit
def _split_range(kv_len, num_splits, split_id, GRANULE: tl.constexpr):
    """Keys ``[start, end)`` of split ``split_id``; empty when past the end."""
    per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), GRANULE) * GRANULE
    start = per_split * split_id
    end = tl.minimum(start + per_split, kv_len)
    return start, end


@triton.jit
def _merge_splits(
    part_ptr,
    lse_ptr,
    req,
    heads,
    mask_h,
    offs_dv,
    mask_dv,
    kv_len,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    BLOCK_H: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
    GRANULE: tl.constexpr,
):
    """The output rows of ``heads``: the filled splits' partials weighed by
    their log-sum-exp, ``BLOCK_S`` splits per load. Loads bypass L1
    (``.cg``): other programs wrote the partials during this launch."""
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    offs_s = tl.arange(0, BLOCK_S)
    # [H, S] log-sum-exps and [H, S, DV] partials of a chunk of splits.
    lse_rows = lse_ptr + req * stride_lb + heads[:, None] * stride_lh + offs_s[None, :]
    part_rows = (
        part_ptr
        + req * stride_pb
        + heads[:, None, None] * stride_ph
        + offs_s[None, :, None] * stride_ps
        + offs_dv[None, None, :]
    )
    # Splits are contiguous and equal (_split_range): the filled ones are a prefix.
    per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), GRANULE) * GRANULE
    for s0 in range(0, num_splits, BLOCK_S):
        split_ids = s0 + offs_s
        # Empty splits left their scratch stale; only count filled ones.
        filled = (split_ids < num_splits) & (split_ids * per_split < kv_len)
        mask_hs = mask_h[:, None] & filled[None, :]
        lse = tl.load(lse_rows + s0, mask=mask_hs, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(
            part_rows + s0 * stride_ps,
            mask=mask_hs[:, :, None] & mask_dv[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m_i, tl.max(lse, axis=1))
        # lse = -inf (weightless keys): shift by 0, not -inf - -inf = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        w = tl.exp(lse - m_safe[:, None])
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * part, axis=1)
        l_i = l_i * alpha + tl.sum(w, axis=1)
        m_i = m_new
    # l_i == 0: no key carried weight, so zeros, not 0/0. Not `l_i > 0`: a NaN
    # l_i fails that too, and NaN must reach the output (see softmax_step).
    return tl.where(l_i[:, None] == 0, 0.0, acc / l_i[:, None])


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    new_k_ptr,
    new_v_ptr,
    loc_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    num_splits_ptr,
    part_ptr,
    lse_ptr,
    count_ptr,
    out_ptr,
    num_rows,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_nkb,
    stride_nkh,
    stride_nvb,
    stride_nvh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_cb,
    stride_ob,
    stride_oh,
    max_splits,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    GRANULE: tl.constexpr,
    F32X3: tl.constexpr,
    UPCAST: tl.constexpr,
    NEW_KV: tl.constexpr,
    PDL: tl.constexpr,
):
    # Grid: (rows, num_kv_heads * HEAD_BLOCKS, max_splits). Under PDL, let the
    # next kernel start (before its own wait it reads only its weights), and
    # wait for the kernel that made q, k, v before touching memory.
    if PDL:
        pdl.gdc_launch_dependents()
        pdl.gdc_wait()
    req = tl.program_id(0)
    head_program = tl.program_id(1)
    kv_head = head_program // HEAD_BLOCKS
    split_id = tl.program_id(2)
    # Query heads kv_head*GROUP + in_group share this kv head.
    in_group = (head_program % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = in_group < GROUP
    heads = kv_head * GROUP + in_group
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < D
    mask_dv = offs_dv < DV
    out_rows = out_ptr + req * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :]
    mask_out = mask_h[:, None] & mask_dv[None, :]

    if req >= num_rows:  # a padded row (a graph's): zeros, no K/V, no metadata read
        if split_id == 0:
            tl.store(out_rows, tl.zeros([BLOCK_H, BLOCK_DV], dtype=out_ptr.dtype.element_ty), mask=mask_out)
        return
    num_splits = tl.minimum(tl.maximum(tl.load(num_splits_ptr + req), 1), max_splits)
    # Splits past the request's count take no part, not even in the merge count.
    if split_id >= num_splits:
        return
    kv_start = tl.load(kv_indptr_ptr + req)
    kv_len = tl.load(kv_indptr_ptr + req + 1) - kv_start
    start, end = _split_range(kv_len, num_splits, split_id, GRANULE)
    # The new token is the last key; with NEW_KV it comes from new_k/new_v,
    # never the pool, so no program reads a row another is writing.
    new_key = kv_len - 1 if NEW_KV else -1
    if NEW_KV:
        new_k = tl.load(new_k_ptr + req * stride_nkb + kv_head * stride_nkh + offs_d, mask=mask_d, other=0.0)
        new_v = tl.load(new_v_ptr + req * stride_nvb + kv_head * stride_nvh + offs_dv, mask=mask_dv, other=0.0)
        if (split_id == 0) & (head_program % HEAD_BLOCKS == 0):
            slot = tl.load(loc_ptr + req).to(tl.int64)
            tl.store(k_ptr + slot * stride_kt + kv_head * stride_kh + offs_d, new_k, mask=mask_d)
            tl.store(v_ptr + slot * stride_vt + kv_head * stride_vh + offs_dv, new_v, mask=mask_dv)

    q = tl.load(
        q_ptr + req * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + offs_n
        mask_n = keys < end
        from_pool = mask_n & (keys != new_key)
        # int64: slot * row stride can pass 2**31 in a large pool.
        slots = tl.load(kv_indices_ptr + kv_start + keys, mask=from_pool, other=0).to(tl.int64)
        k = load_rows(k_base, slots, stride_kt, offs_d, from_pool, mask_d)
        if NEW_KV:
            k = tl.where((keys == new_key)[:, None], new_k[None, :], k)
        # Logits in the exp2 domain (qk_scale = sm_scale * log2(e)).
        s = mm(q, tl.trans(k), F32X3, UPCAST) * qk_scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        v = load_rows(v_base, slots, stride_vt, offs_dv, from_pool, mask_dv)
        if NEW_KV:
            v = tl.where((keys == new_key)[:, None], new_v[None, :], v)
        acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, F32X3, UPCAST)

    # All-weightless keys give 0, not 0/0: the merge's 0 * NaN would still be NaN.
    part = tl.where(l_i[:, None] == 0, 0.0, acc / l_i[:, None])
    if num_splits == 1:  # nothing to merge: the split's output is the row's
        tl.store(out_rows, part.to(out_ptr.dtype.element_ty), mask=mask_out)
        return
    if start < end:
        part_off = req * stride_pb + heads[:, None] * stride_ph + split_id * stride_ps
        tl.store(part_ptr + part_off + offs_dv[None, :], part, mask=mask_out)
        # Natural-log LSE of the sm_scale-scaled logits.
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
        tl.store(lse_ptr + req * stride_lb + heads * stride_lh + split_id, lse, mask=mask_h)
    # The last split to arrive merges (partials stored before the acq_rel
    # increment) and resets the count for the next launch.
    tl.debug_barrier()
    count = count_ptr + req * stride_cb + head_program
    arrived = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
    if arrived == num_splits - 1:
        result = _merge_splits(
            part_ptr,
            lse_ptr,
            req,
            heads,
            mask_h,
            offs_dv,
            mask_dv,
            kv_len,
            num_splits,
            stride_pb,
            stride_ph,
            stride_ps,
            stride_lb,
            stride_lh,
            BLOCK_H,
            BLOCK_DV,
            BLOCK_S,
            GRANULE,
        )
        tl.store(out_rows, result.to(out_ptr.dtype.element_ty), mask=mask_out)
        tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")


INTERPRETED = not runs_compiled(_decode_kernel)  # TRITON_INTERPRET=1: bf16 dots need UPCAST (see mm)
_launch_decode = FastLauncher(_decode_kernel)


def choose_num_kv_splits(
    kv_lens: torch.Tensor,
    max_kv_splits: int,
    out: torch.Tensor,
    tokens_per_split: int = DEFAULT_TOKENS_PER_SPLIT,
) -> torch.Tensor:
    """``out[i] = clamp(ceil(kv_lens[i] / tokens_per_split), 1, max_kv_splits)``,
    on the device (graph-safe); returns ``out``."""
    if max_kv_splits < 1 or tokens_per_split < 1:
        raise InvalidInputError(
            f"choose_num_kv_splits: expected max_kv_splits >= 1 and tokens_per_split >= 1, "
            f"got {max_kv_splits} and {tokens_per_split}"
        )
    if out.shape != kv_lens.shape:
        raise InvalidInputError(
            f"choose_num_kv_splits: expected out of shape {list(kv_lens.shape)}, got {list(out.shape)}"
        )
    splits = torch.div(kv_lens + (tokens_per_split - 1), tokens_per_split, rounding_mode="floor")
    out.copy_(splits.clamp_(1, max_kv_splits))
    return out


def merge_block_s(block_h: int, block_dv: int) -> int:
    """Splits the merge loads at once: a chunk of at most ``MERGE_CHUNK_VALUES``; 1 to 8."""
    return max(1, min(8, MERGE_CHUNK_VALUES // (block_h * block_dv)))


def decode_block_h(group: int, dtype: torch.dtype) -> int:
    """Query heads per program; fp32 stays at 16 (a wider 3xTF32 tile spills on sm_90)."""
    if dtype == torch.float32:
        return DECODE_BLOCK_H
    return min(max(DECODE_BLOCK_H, triton.next_power_of_2(group)), DECODE_MAX_BLOCK_H)


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_programs_per_sm(head_dim: int, v_head_dim: int) -> int:
    """Programs per SM the split axis fills by default: 4 for heads of at most
    64 values, 2 for wider ones (measured, docs/BENCHMARKS.md)."""
    return 4 if max(head_dim, v_head_dim) <= 64 else 2


@functools.lru_cache(maxsize=1024)
def grid_kv_splits(
    bs: int,
    num_q_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    max_kv_splits: int,
    device: torch.device,
    launch: Optional[DecodeLaunch] = None,
    *,
    head_dim: int,
    v_head_dim: Optional[int] = None,
) -> int:
    """The grid's split axis for a batch of ``bs``: the most splits that keep
    the grid within ``programs_per_sm`` programs per SM, in
    ``[1, max_kv_splits]`` (off CUDA: ``max_kv_splits``). ``bs`` is fixed per
    captured graph, so this host-side choice is graph-safe.
    """
    check_positive_int("max_kv_splits", max_kv_splits)
    if bs < 0 or num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise InvalidInputError(
            f"grid_kv_splits: expected bs >= 0 and num_q_heads a multiple of num_kv_heads > 0, "
            f"got bs={bs}, num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}"
        )
    check_positive_int("head_dim", head_dim)
    v_head_dim = head_dim if v_head_dim is None else check_positive_int("v_head_dim", v_head_dim)
    launch = launch or default_decode_launch(dtype)
    if not launch.cap_splits or device.type != "cuda":
        return max_kv_splits
    per_sm = launch.programs_per_sm or default_programs_per_sm(head_dim, v_head_dim)
    group = num_q_heads // num_kv_heads
    head_programs = num_kv_heads * triton.cdiv(group, decode_block_h(group, dtype))
    wanted = (_num_sms(device) * per_sm) // (max(bs, 1) * head_programs)
    return max(1, min(max_kv_splits, wanted))


@functools.lru_cache(maxsize=256)
def decode_kernel_meta(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dv: int,
    dtype: torch.dtype,
    launch: Optional[DecodeLaunch] = None,
    new_kv: bool = False,
    chained: bool = False,
) -> dict:
    """The decode kernel's compile-time arguments (shared by the launcher and
    the sm_90 compile test). Cached: callers only unpack the dict."""
    launch = launch or default_decode_launch(dtype)
    group = num_q_heads // num_kv_heads
    block_h = decode_block_h(group, dtype)
    return dict(
        GROUP=group,
        HEAD_BLOCKS=triton.cdiv(group, block_h),
        D=head_dim,
        DV=dv,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(dv),
        BLOCK_H=block_h,
        BLOCK_N=launch.block_n,
        BLOCK_S=launch.merge_splits or merge_block_s(block_h, triton.next_power_of_2(dv)),
        GRANULE=SPLIT_GRANULE,
        F32X3=dtype == torch.float32,
        UPCAST=INTERPRETED and dtype == torch.bfloat16,
        NEW_KV=new_kv,
        PDL=chained,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **({"launch_pdl": True} if chained else {}),
    )


def _check_scratch(bs, num_q_heads, dv, splits, max_kv_splits, attn_logits, attn_lse, merge_counts) -> None:
    ok_logits = (
        attn_logits.dim() == 4
        and attn_logits.shape[0] >= bs
        and attn_logits.shape[1] == num_q_heads
        and attn_logits.shape[2] >= splits
        and attn_logits.shape[3] >= dv
    )
    ok_lse = (
        attn_lse.dim() == 3
        and attn_lse.shape[0] >= bs
        and attn_lse.shape[1] == num_q_heads
        and attn_lse.shape[2] >= splits
    )
    if not (ok_logits and ok_lse) or attn_logits.dtype != torch.float32 or attn_lse.dtype != torch.float32:
        raise InvalidInputError(
            f"decode_attention: expected float32 scratch attn_logits [>={bs}, {num_q_heads}, "
            f">={splits}, >={dv}] and attn_lse [>={bs}, {num_q_heads}, >={splits}] "
            f"(grid_kv_splits of max_kv_splits={max_kv_splits}), "
            f"got {attn_logits.dtype} {list(attn_logits.shape)} and {attn_lse.dtype} {list(attn_lse.shape)}"
        )
    ok_counts = merge_counts.dim() == 2 and merge_counts.shape[0] >= bs and merge_counts.shape[1] >= num_q_heads
    if not ok_counts or merge_counts.dtype != torch.int32 or merge_counts.stride(1) != 1:
        raise InvalidInputError(
            f"decode_attention: expected merge_counts int32 [>={bs}, >={num_q_heads}], contiguous rows, "
            f"zeroed once (every launch leaves it zero), got {merge_counts.dtype} {list(merge_counts.shape)} "
            f"strides {merge_counts.stride()}"
        )


class DecodePlan:
    """A decode launch with everything fixed that every layer of a step
    shares, checked on the first layer's tensors; :meth:`launch` takes one
    layer's tensors, compared with the first's layout. Args as
    :func:`decode_attention`.
    """

    def __init__(
        self,
        q,
        k_cache,
        v_cache,
        out,
        kv_indptr,
        kv_indices,
        attn_logits,
        attn_lse,
        merge_counts,
        num_kv_splits,
        max_kv_splits,
        sm_scale,
        launch=None,
        *,
        new_k=None,
        new_v=None,
        out_cache_loc=None,
        num_rows=None,
    ):
        rows, num_q_heads, dv = check_attention_args("decode_attention", "rows", q, k_cache, v_cache, out)
        bs = check_num_rows("decode_attention", rows, num_rows)
        splits = grid_kv_splits(
            bs,
            num_q_heads,
            k_cache.shape[1],
            q.dtype,
            max_kv_splits,
            q.device,
            launch,
            head_dim=k_cache.shape[2],
            v_head_dim=dv,
        )
        _check_scratch(bs, num_q_heads, dv, splits, max_kv_splits, attn_logits, attn_lse, merge_counts)
        check_new_kv("decode_attention", rows, bs, k_cache, v_cache, new_k, new_v, out_cache_loc)
        check_last_dim_contiguous(
            "decode_attention",
            q=q,
            k_cache=k_cache,
            v_cache=v_cache,
            out=out,
            attn_logits=attn_logits,
            attn_lse=attn_lse,
            **({} if new_k is None else dict(new_k=new_k, new_v=new_v)),
        )
        num_kv_heads, head_dim = k_cache.shape[1], q.shape[2]
        self.meta = decode_kernel_meta(
            num_q_heads, num_kv_heads, head_dim, dv, q.dtype, launch, new_k is not None, pdl.enabled(q.device)
        )
        self.grid = (rows, num_kv_heads * self.meta["HEAD_BLOCKS"], splits)
        self.new_kv = new_k is not None
        self._layout = layer_layout(q, k_cache, v_cache, out, new_k, new_v)
        metadata = (out_cache_loc, kv_indptr, kv_indices, num_kv_splits, attn_logits, attn_lse, merge_counts)
        self._slots, self._num_rows = out_cache_loc, bs
        args = _decode_args(q, k_cache, v_cache, out, new_k, new_v, metadata, bs, sm_scale * _LOG2E, splits)
        self._launch = StepLaunch(_launch_decode, self.grid, args, self.meta, layer_positions=_LAYER_ARGS)

    def launch(self, q, k_cache, v_cache, out, new_k=None, new_v=None, layer=None) -> bool:
        """Attend one layer; False, launching nothing, when its tensors are laid
        out unlike the first layer's. ``layer``: its index, to launch again
        next step (``StepLaunch.launch_again``)."""
        # No new K/V to write: q stands in for them, unread.
        written = (new_k, new_v) if self.new_kv else (q, q)
        if layer is not None and self._launch.launch_again(layer, q, k_cache, v_cache, *written, out):
            return True
        if layer_layout(q, k_cache, v_cache, out, new_k, new_v) != self._layout:
            return False
        if self.grid[0] == 0:
            return True
        self._launch.launch(q, k_cache, v_cache, *written, out, layer=layer)
        return True

    def rebind_slots(self, out_cache_loc: Optional[torch.Tensor]) -> bool:
        """Take the next step's new-token slots, the rest unchanged; False where it cannot."""
        if not self.new_kv:  # its launches read no slots
            return out_cache_loc is self._slots
        if not rebind_slots(
            "decode_attention", self._slots, out_cache_loc, self._num_rows, [(self._launch, _SLOTS_ARG)]
        ):
            return False
        self._slots = out_cache_loc
        return True


# The kernel's arguments that are one layer's own: q, its pools, its new K/V, out.
_LAYER_ARGS = (0, 1, 2, 3, 4, 12)
_SLOTS_ARG = 5  # out_cache_loc, the step's new-token slots


def _decode_args(
    q, k_cache, v_cache, out, new_k, new_v, metadata, num_rows: int, scale_log2: float, splits: int
) -> tuple:
    """The kernel's runtime arguments, in its order."""
    new_k, new_v = (new_k, new_v) if new_k is not None else (q, q)  # not read when the launch writes no K/V
    loc, kv_indptr, kv_indices, num_kv_splits, attn_logits, attn_lse, merge_counts = metadata
    loc = kv_indptr if loc is None else loc  # not read either; a step tensor, never a layer's
    return (
        q, k_cache, v_cache, new_k, new_v, loc, kv_indptr, kv_indices, num_kv_splits,
        attn_logits, attn_lse, merge_counts, out, num_rows, scale_log2,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1),
        *attn_logits.stride()[:3], *attn_lse.stride()[:2], merge_counts.stride(0),
        out.stride(0), out.stride(1), splits,
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    attn_logits: torch.Tensor,
    attn_lse: torch.Tensor,
    merge_counts: torch.Tensor,
    num_kv_splits: torch.Tensor,
    max_kv_splits: int,
    sm_scale: float,
    launch: Optional[DecodeLaunch] = None,
    *,
    new_k: Optional[torch.Tensor] = None,
    new_v: Optional[torch.Tensor] = None,
    out_cache_loc: Optional[torch.Tensor] = None,
    num_rows: Optional[int] = None,
) -> DecodePlan:
    """Decode attention over paged keys into ``out`` (padded rows and requests
    without keys get zeros); returns the :class:`DecodePlan` for later layers.

    Request r's keys are ``kv_indices[kv_indptr[r]:kv_indptr[r + 1]]``.
    Scratch: ``attn_logits [>= bs, Hq, >= S, >= Dv]`` and ``attn_lse [>= bs,
    Hq, >= S]`` float32, ``S = grid_kv_splits(...)``; ``merge_counts [>= bs,
    >= Hq]`` int32, zeroed once (every launch leaves it zero; concurrent
    launches need their own). ``num_kv_splits [bs]`` is clamped on the
    device. Given ``new_k, new_v, out_cache_loc``, the launch writes the new
    tokens' K/V and takes each request's last key from them. ``num_rows``:
    the rows that are requests (default: all).
    """
    plan = DecodePlan(
        q,
        k_cache,
        v_cache,
        out,
        kv_indptr,
        kv_indices,
        attn_logits,
        attn_lse,
        merge_counts,
        num_kv_splits,
        max_kv_splits,
        sm_scale,
        launch,
        new_k=new_k,
        new_v=new_v,
        out_cache_loc=out_cache_loc,
        num_rows=num_rows,
    )
    plan.launch(q, k_cache, v_cache, out, new_k, new_v)  # its own tensors: always launches
    return plan
