"""A step's paged attention metadata in one launch: the values of
``metadata.fill_lengths``, ``metadata.fill_kv_indices`` and
``decode.choose_num_kv_splits``, bit for bit, without a host sync.

Grid: one program per request, then one per ``_TAIL_BLOCK`` entries of
``kv_indices``. Program ``b`` sums every request's lengths before its own
for its offsets and copies its page-table row; the tail programs write the
dummy slot past the step's last key, as the torch fill does.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_piecewise.backends.triton_kernels.decode import DEFAULT_TOKENS_PER_SPLIT
from sgl_piecewise.backends.triton_kernels.tiles import check_last_dim_contiguous
from sgl_piecewise.checks import check_positive_int, check_tensor
from sgl_piecewise.internals.triton_launch import FastLauncher
from sgl_piecewise.memory import DUMMY_SLOT

_ROW_BLOCK = 256  # page-table entries a request's program copies per iteration
_TAIL_BLOCK = 1024  # kv_indices entries per tail program


@triton.jit
def _fill_kernel(
    req_pool_ptr,
    seq_lens_ptr,
    extend_lens_ptr,
    req_to_token_ptr,
    q_lens_ptr,
    kv_lens_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    num_splits_ptr,
    bs,
    width,
    req_to_token_stride,
    context,
    num_indices,
    max_splits,
    tokens_per_split,
    UNIFORM: tl.constexpr,  # every request has `width` new tokens (extend_lens unused)
    ADD_NEW: tl.constexpr,  # seq_lens hold the prefix only: key extent = prefix + new
    SPLITS: tl.constexpr,  # write the decode split counts
    BLOCK_BS: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    TAIL_BLOCK: tl.constexpr,
    DUMMY: tl.constexpr,
):
    pid = tl.program_id(0)
    reqs = tl.arange(0, BLOCK_BS)
    in_batch = reqs < bs
    if UNIFORM:
        q_all = tl.where(in_batch, width, 0)
    else:
        q_all = tl.load(extend_lens_ptr + reqs, mask=in_batch, other=0).to(tl.int32)
    kv_all = tl.load(seq_lens_ptr + reqs, mask=in_batch, other=0).to(tl.int32)
    if ADD_NEW:
        kv_all += q_all
    if pid == 0:  # a program of every grid, even of an empty batch
        tl.store(qo_indptr_ptr, 0)
        tl.store(kv_indptr_ptr, 0)
    if pid < bs:
        before, mine = reqs < pid, reqs == pid
        q_start = tl.sum(tl.where(before, q_all, 0), axis=0)
        kv_start = tl.sum(tl.where(before, kv_all, 0), axis=0)
        q_len = tl.sum(tl.where(mine, q_all, 0), axis=0)
        kv_len = tl.sum(tl.where(mine, kv_all, 0), axis=0)
        tl.store(q_lens_ptr + pid, q_len)
        tl.store(kv_lens_ptr + pid, kv_len)
        tl.store(qo_indptr_ptr + pid + 1, q_start + q_len)
        tl.store(kv_indptr_ptr + pid + 1, kv_start + kv_len)
        if SPLITS:
            splits = (kv_len + tokens_per_split - 1) // tokens_per_split
            tl.store(num_splits_ptr + pid, tl.minimum(tl.maximum(splits, 1), max_splits))
        row = req_to_token_ptr + tl.load(req_pool_ptr + pid).to(tl.int64) * req_to_token_stride
        cols = tl.arange(0, ROW_BLOCK)
        for start in range(0, kv_len, ROW_BLOCK):
            col = start + cols
            dst = kv_start + col
            keep = (col < kv_len) & (dst < num_indices)
            # A key extent past the row reads the row's last entry, as the torch fill does.
            slot = tl.load(row + tl.minimum(col, context - 1), mask=keep)
            tl.store(kv_indices_ptr + dst, slot, mask=keep)
    else:
        total = tl.sum(kv_all, axis=0)
        pos = (pid - bs) * TAIL_BLOCK + tl.arange(0, TAIL_BLOCK)
        tail = (pos >= total) & (pos < num_indices)
        tl.store(kv_indices_ptr + pos, tl.full([TAIL_BLOCK], DUMMY, tl.int32), mask=tail)


_launcher = FastLauncher(_fill_kernel)


def fill_paged_metadata(
    meta,
    kv_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: Optional[torch.Tensor],
    num_kv_splits: Optional[torch.Tensor] = None,
    max_kv_splits: int = 1,
    tokens_per_split: int = DEFAULT_TOKENS_PER_SPLIT,
) -> None:
    """Write ``meta``'s lengths and indptrs, ``kv_indices`` and, if given,
    ``num_kv_splits``, in one launch. ``extend_lens`` None: every request has
    ``meta.max_q_len`` new tokens."""
    bs = meta.q_lens.shape[0]
    _check_args(bs, meta, kv_indices, req_to_token, req_pool_indices, seq_lens, extend_lens, num_kv_splits)
    check_positive_int("fill_paged_metadata: max_kv_splits", max_kv_splits)
    check_positive_int("fill_paged_metadata: tokens_per_split", tokens_per_split)
    uniform = extend_lens is None
    mode = meta.forward_mode
    grid = (bs + max(1, triton.cdiv(kv_indices.shape[0], _TAIL_BLOCK)),)
    _launcher(
        grid,
        req_pool_indices,
        seq_lens,
        seq_lens if uniform else extend_lens,
        req_to_token,
        meta.q_lens,
        meta.kv_lens,
        meta.qo_indptr,
        meta.kv_indptr,
        kv_indices,
        num_kv_splits if num_kv_splits is not None else meta.q_lens,
        bs,
        meta.max_q_len if uniform else 0,
        req_to_token.stride(0),
        req_to_token.shape[1],
        kv_indices.shape[0],
        max_kv_splits,
        tokens_per_split,
        UNIFORM=uniform,
        ADD_NEW=mode.seq_lens_exclude_new_tokens(),
        SPLITS=num_kv_splits is not None,
        BLOCK_BS=triton.next_power_of_2(max(bs, 1)),
        ROW_BLOCK=_ROW_BLOCK,
        TAIL_BLOCK=_TAIL_BLOCK,
        DUMMY=DUMMY_SLOT,
        num_warps=4,
    )


def _check_args(bs, meta, kv_indices, req_to_token, req_pool_indices, seq_lens, extend_lens, num_kv_splits) -> None:
    """Every tensor the kernel touches: on the page table's device,
    contiguous, and as long as the kernel indexes it."""
    index = (torch.int32, torch.int64)
    wanted = [
        ("req_pool_indices", req_pool_indices, bs, index), ("seq_lens", seq_lens, bs, index),
        ("extend_lens", extend_lens, bs, index), ("meta.q_lens", meta.q_lens, bs, torch.int32),
        ("meta.kv_lens", meta.kv_lens, bs, torch.int32), ("meta.qo_indptr", meta.qo_indptr, bs + 1, torch.int32),
        ("meta.kv_indptr", meta.kv_indptr, bs + 1, torch.int32), ("kv_indices", kv_indices, None, torch.int32),
        ("num_kv_splits", num_kv_splits, bs, torch.int32),
    ]  # fmt: skip
    check_tensor("fill_paged_metadata: req_to_token", req_to_token, shape=(None, None), dtype=torch.int32)
    given = {"req_to_token": req_to_token}
    for name, t, length, dtype in wanted:
        if t is not None:
            check_tensor(f"fill_paged_metadata: {name}", t, shape=(length,), dtype=dtype, device=req_to_token.device)
            given[name] = t
    check_last_dim_contiguous("fill_paged_metadata", **given)
