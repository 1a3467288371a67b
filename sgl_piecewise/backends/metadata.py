"""Graph metadata shared by the graph-capable backends: the length fields every
kernel reads and the device-side fill helpers (the Pattern A base class that
uses them is ``static_graph.py``).

Why one module: upstream SGLang bugs (PRs 26665, 22404, 26512) were bugs where the eager path, the capture
hook and the replay hook each computed a length, a page table or an indptr
their own way. Here every path of every backend goes through the same three
steps — get a metadata object (fresh tensors when eager, views of static
buffers when graphed), fill it with the backend's one ``_fill_metadata``, make
it ``forward_metadata`` — and the fill helpers below are the only code that
writes lengths, indptrs and KV indices.

Every fill helper runs on the device with value-independent shapes: no
``.item()``, no ``.tolist()``, no boolean-mask indexing, so the replay path
never waits for the device and a fill may even be captured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from sgl_piecewise.backends import lengths
from sgl_piecewise.errors import InvalidInputError, UnsupportedModeError
from sgl_piecewise.forward import ForwardBatch, ForwardMode, SpecInfo
from sgl_piecewise.memory import DUMMY_SLOT

# What the capture hook passes as ``seq_lens_sum`` when it delegates to replay:
# capture has no host copy of the lengths, and no backend here reads the sum
# on the replay path (key extents live on the device).
SEQ_LENS_SUM_UNKNOWN = -1


@dataclass
class LengthMetadata:
    """The fields every backend's kernels read, for ``bs`` requests.

    ``max_q_len`` and ``num_tokens`` are host ints: for graph modes they are
    the uniform width ``s`` (upstream SGLang PR 25002) and ``bs * s``, constants baked into
    the captured kernels. ``masked``: the step reads a custom (tree) mask;
    for graphs this is fixed at capture.
    """

    forward_mode: ForwardMode
    bs: int
    max_q_len: int
    num_tokens: int
    q_lens: torch.Tensor  # [bs] int32, new tokens per request
    kv_lens: torch.Tensor  # [bs] int32, key extent (prefix + new), upstream SGLang PR 26512
    qo_indptr: torch.Tensor  # [bs+1] int32, cu_seqlens_q
    kv_indptr: torch.Tensor  # [bs+1] int32, cu_seqlens_k
    masked: bool


def graph_query_width(mode: ForwardMode, spec_info: Optional[SpecInfo]) -> int:
    """Query rows per request in a graph step (upstream SGLang PR 25002).

    DECODE: 1. TARGET_VERIFY and DRAFT_EXTEND_V2: ``spec_info.num_tokens_per_req``.
    IDLE: 1 — an idle graph is a decode graph whose requests are all padding.
    Ragged modes (EXTEND, MIXED, DRAFT_EXTEND v1) have no graph here.
    """
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
    """``(q_lens, kv_lens)`` of an eager batch, int64 on the host: they size
    the eager metadata. The key extent comes from ``lengths.kv_lens`` as on
    the device (upstream SGLang PR 26512)."""
    q_lens = torch.tensor(batch.extend_seq_lens_cpu, dtype=torch.int64)
    return q_lens, lengths.kv_lens(batch.forward_mode, batch.seq_lens_cpu.to(torch.int64), q_lens)


def has_custom_mask(spec_info: Optional[SpecInfo]) -> bool:
    return spec_info is not None and spec_info.custom_mask is not None


def fill_lengths(meta: LengthMetadata, seq_lens: torch.Tensor, extend_lens: Optional[torch.Tensor]) -> None:
    """Write ``q_lens``, ``kv_lens`` and both indptrs from the step's lengths.

    ``seq_lens [bs]``: as in ``ForwardBatch`` (the prefix in TARGET_VERIFY and
    DRAFT_EXTEND_V2); ``extend_lens [bs]``: new tokens per request, or None
    when every request has ``meta.max_q_len``.
    """
    if extend_lens is None:
        meta.q_lens.fill_(meta.max_q_len)
    else:
        meta.q_lens.copy_(extend_lens)
    meta.kv_lens.copy_(lengths.kv_lens(meta.forward_mode, seq_lens.to(torch.int32), meta.q_lens))
    lengths.cumsum_with_zero(meta.q_lens, out=meta.qo_indptr)
    lengths.cumsum_with_zero(meta.kv_lens, out=meta.kv_indptr)


def request_of_position(indptr: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """For flat positions into a ragged layout with ``indptr [bs+1]``, the
    request each belongs to, ``[n]`` int64 in ``[0, bs-1]`` (positions past the
    end map to the last request; callers mask them)."""
    bs = indptr.shape[0] - 1
    req = torch.searchsorted(indptr[1:], positions.to(indptr.dtype), right=True)
    return req.clamp_(max=bs - 1)


def fill_kv_indices(
    kv_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
) -> None:
    """Flatten the page table: ``kv_indices[kv_indptr[b] + j] = req_to_token[row_b, j]``
    for ``j < kv_len_b``; every entry past ``kv_indptr[bs]`` is the dummy slot.

    ``kv_indices [N]`` (any N: the batch total when eager, the static maximum
    when graphed) is rewritten entirely, so nothing stale survives a replay.
    """
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
    """``mask_indptr [bs+1]``: offset of each request's ``[q_len, kv_len]`` block
    in the flat custom mask (``SpecInfo.custom_mask``)."""
    blocks = q_lens.to(mask_indptr.dtype) * kv_lens.to(mask_indptr.dtype)
    mask_indptr[:1].zero_()  # not `mask_indptr[0] = 0`: that copies a host scalar (a sync on CUDA)
    torch.cumsum(blocks, dim=0, out=mask_indptr[1:])


def copy_custom_mask(dst: torch.Tensor, custom_mask: torch.Tensor) -> None:
    """Copy the flat mask into ``dst``'s head and clear the tail, so the
    buffer's bytes depend on this step only (capture == replay, byte for byte)."""
    n = custom_mask.numel()
    if n > dst.numel():
        raise InvalidInputError(
            f"custom_mask: expected at most {dst.numel()} elements (the static buffer "
            f"from init_cuda_graph_state), got {n}; raise max_num_tokens or the context length"
        )
    dst[:n].copy_(custom_mask.reshape(-1))
    dst[n:].zero_()
