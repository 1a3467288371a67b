"""The length fields every kernel reads, and the only code that writes
lengths, indptrs and KV indices, on every path of every backend, so eager,
capture and replay cannot compute them differently. Every helper runs on the
device with value-independent shapes (no host sync; a fill may be captured).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from sgl_piecewise.backends import lengths
from sgl_piecewise.errors import InvalidInputError, UnsupportedModeError
from sgl_piecewise.forward import ForwardBatch, ForwardMode, SpecInfo
from sgl_piecewise.memory import DUMMY_SLOT

# The ``seq_lens_sum`` capture passes to replay: no backend here reads it.
SEQ_LENS_SUM_UNKNOWN = -1


@dataclass
class LengthMetadata:
    """The fields every backend's kernels read, for ``bs`` requests.
    ``max_q_len`` and ``num_tokens`` are host ints, baked into captured
    kernels; ``masked``: the step reads a tree mask."""

    forward_mode: ForwardMode
    bs: int
    max_q_len: int
    num_tokens: int
    q_lens: torch.Tensor  # [bs] int32, new tokens per request
    kv_lens: torch.Tensor  # [bs] int32, key extent (prefix + new)
    qo_indptr: torch.Tensor  # [bs+1] int32, cu_seqlens_q
    kv_indptr: torch.Tensor  # [bs+1] int32, cu_seqlens_k
    masked: bool


def graph_query_width(mode: ForwardMode, spec_info: Optional[SpecInfo]) -> int:
    """Query rows per request in a graph step: 1 for DECODE and IDLE,
    ``spec_info.num_tokens_per_req`` for TARGET_VERIFY and DRAFT_EXTEND_V2."""
    if not mode.is_cuda_graph():
        raise UnsupportedModeError(
            f"graph capture: expected one of DECODE, TARGET_VERIFY, IDLE, DRAFT_EXTEND_V2, "
            f"got {mode.name}; ragged modes run eagerly (or piecewise, attention eager)"
        )
    if mode.is_idle():
        return 1
    num_tokens_per_req = spec_info.num_tokens_per_req if spec_info is not None else None
    return lengths.query_width(mode, num_tokens_per_req)


def host_lengths(batch: ForwardBatch) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q_lens, kv_lens)`` of an eager batch, int64 on the host (they size the metadata)."""
    q_lens = torch.tensor(batch.extend_seq_lens_cpu, dtype=torch.int64)
    return q_lens, lengths.kv_lens(batch.forward_mode, batch.seq_lens_cpu.to(torch.int64), q_lens)


def has_custom_mask(spec_info: Optional[SpecInfo]) -> bool:
    return spec_info is not None and spec_info.custom_mask is not None


def fill_lengths(meta: LengthMetadata, seq_lens: torch.Tensor, extend_lens: Optional[torch.Tensor]) -> None:
    """Write ``q_lens``, ``kv_lens`` and both indptrs. ``extend_lens`` None:
    every request has ``meta.max_q_len`` new tokens."""
    if extend_lens is None:
        meta.q_lens.fill_(meta.max_q_len)
    else:
        meta.q_lens.copy_(extend_lens)
    meta.kv_lens.copy_(lengths.kv_lens(meta.forward_mode, seq_lens.to(torch.int32), meta.q_lens))
    lengths.cumsum_with_zero(meta.q_lens, out=meta.qo_indptr)
    lengths.cumsum_with_zero(meta.kv_lens, out=meta.kv_indptr)


def request_of_position(indptr: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The request each flat position of a ragged layout belongs to (past the end: the last)."""
    bs = indptr.shape[0] - 1
    req = torch.searchsorted(indptr[1:], positions.to(indptr.dtype), right=True)
    return req.clamp_(max=bs - 1)


def fill_kv_indices(
    kv_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
) -> None:
    """``kv_indices[kv_indptr[b] + j] = req_to_token[row_b, j]`` for ``j <
    kv_len_b``; every later entry is the dummy slot, so nothing stale survives."""
    bs = req_pool_indices.shape[0]
    n = kv_indices.shape[0]
    if bs == 0 or n == 0:
        kv_indices.fill_(DUMMY_SLOT)
        return
    pos = torch.arange(n, dtype=kv_indptr.dtype, device=kv_indices.device)
    req = request_of_position(kv_indptr, pos)
    col = (pos - kv_indptr[req]).clamp_(0, req_to_token.shape[1] - 1).long()
    slots = req_to_token[req_pool_indices.long()[req], col]
    kv_indices.copy_(torch.where(pos < kv_indptr[bs], slots, DUMMY_SLOT))


def fill_mask_indptr(mask_indptr: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor) -> None:
    """Each request's ``[q_len, kv_len]`` block offset in the flat custom mask."""
    blocks = q_lens.to(mask_indptr.dtype) * kv_lens.to(mask_indptr.dtype)
    mask_indptr[:1].zero_()  # not `mask_indptr[0] = 0`: that copies a host scalar (a sync on CUDA)
    torch.cumsum(blocks, dim=0, out=mask_indptr[1:])


def copy_custom_mask(dst: torch.Tensor, custom_mask: torch.Tensor) -> None:
    """Copy the flat mask into ``dst``'s head and clear the tail (capture == replay)."""
    n = custom_mask.numel()
    if n > dst.numel():
        raise InvalidInputError(
            f"custom_mask: expected at most {dst.numel()} elements (the static buffer "
            f"from init_cuda_graph_state), got {n}; raise max_num_tokens or the context length"
        )
    dst[:n].copy_(custom_mask.reshape(-1))
    dst[n:].zero_()
