"""The graph-safe PyTorch backend (``"torch"``): every mode, pure torch ops,
the whole batch at once with shapes that depend only on the batch size. Keys
are gathered through a page table ``[bs, W]`` and hidden by a ``[bs, S, W]``
mask built once per step; graphed, ``W`` is the pool's context length and
``S`` the uniform query width. Ragged eager steps gather queries into
``[bs, max_q_len]`` and back.

Gathered values past a request's extent are zeroed, not only weighted 0
(0 * NaN is NaN); a row whose visible keys all weigh 0 gets zeros, as SDPA gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sgl_piecewise.backends import lengths
from sgl_piecewise.backends.metadata import (
    LengthMetadata,
    fill_lengths,
    fill_mask_indptr,
    has_custom_mask,
    host_lengths,
    request_of_position,
)
from sgl_piecewise.backends.static_graph import StaticBuffers, StaticGraphBackend
from sgl_piecewise.forward import ForwardBatch, ForwardMode

# Finite: a row that sees no key normalises over hidden keys, not 0/0; their weights are then zeroed.
_MASKED = torch.finfo(torch.float32).min


@dataclass
class TorchGraphMetadata(LengthMetadata):
    mask_indptr: Optional[torch.Tensor]  # [bs+1] int64 block offsets in the custom mask
    page_table: torch.Tensor  # [bs, W] int64: slot of key j of request b
    hidden: torch.Tensor  # [bs, S, W] bool: query row i of request b may not see key j
    past_extent: torch.Tensor  # [bs, W] bool: key j is past request b's keys (j >= kv_len)
    # Ragged eager steps only:
    q_rows: Optional[torch.Tensor]  # [bs * S] int64: token row behind padded query (b, i)
    token_src: Optional[torch.Tensor]  # [T] int64: padded query row each token's output is


class TorchGraphBackend(StaticGraphBackend):
    """Pure-PyTorch attention that can be captured in a CUDA graph. Per layer
    it holds the gathered keys and values in float32 and the logits
    ``[bs, Hq, S, W]``."""

    name = "torch"

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        # One key per padded request: every padded row has something to attend.
        return 1

    def _alloc_metadata(self, batch: ForwardBatch) -> TorchGraphMetadata:
        bs, tokens, new = batch.batch_size, batch.num_tokens, self._new
        q_cpu, kv_cpu = host_lengths(batch)
        width, keys = max(batch.extend_seq_lens_cpu, default=0), lengths.max_kv_len(kv_cpu)
        ragged = any(n != width for n in batch.extend_seq_lens_cpu)
        masked = has_custom_mask(batch.spec_info)
        return TorchGraphMetadata(
            forward_mode=batch.forward_mode,
            bs=bs,
            max_q_len=width,
            num_tokens=tokens,
            q_lens=new(bs),
            kv_lens=new(bs),
            qo_indptr=new(bs + 1),
            kv_indptr=new(bs + 1),
            masked=masked,
            mask_indptr=new(bs + 1, dtype=torch.int64) if masked else None,
            page_table=new(bs, keys, dtype=torch.int64),
            hidden=new(bs, width, keys, dtype=torch.bool),
            past_extent=new(bs, keys, dtype=torch.bool),
            q_rows=new(bs * width, dtype=torch.int64) if ragged else None,
            token_src=new(tokens, dtype=torch.int64) if ragged else None,
        )

    def _alloc_graph_buffers(self, buffers: StaticBuffers, max_bs: int, max_num_tokens: int) -> None:
        context = self.req_to_token_pool.max_context_len
        buffers.alloc_lengths(max_bs)
        buffers.alloc("mask_indptr", (max_bs + 1,), torch.int64)
        buffers.alloc("page_table", (max_bs, context), torch.int64)
        # One row of keys per graph query row: [max_num_tokens, context] bool.
        buffers.alloc("hidden", (max_num_tokens, context), torch.bool)
        buffers.alloc("past_extent", (max_bs, context), torch.bool)

    def _bind_metadata(self, bs: int, width: int, mode: ForwardMode, spec_info) -> TorchGraphMetadata:
        b = self._buffers
        context = self.req_to_token_pool.max_context_len
        masked = has_custom_mask(spec_info)
        return TorchGraphMetadata(
            **b.length_views(bs, width, mode, masked),
            mask_indptr=b["mask_indptr"][: bs + 1] if masked else None,
            page_table=b["page_table"][:bs],
            hidden=b["hidden"][: bs * width].view(bs, width, context),
            past_extent=b["past_extent"][:bs],
            q_rows=None,
            token_src=None,
        )

    def _fill_metadata(self, meta, bs, req_pool_indices, seq_lens, extend_lens, mode, spec_info) -> None:
        fill_lengths(meta, seq_lens, extend_lens)
        table = self.req_to_token_pool.req_to_token
        meta.page_table.copy_(table[req_pool_indices.long(), : meta.page_table.shape[1]])
        if meta.q_rows is not None:
            _fill_ragged_rows(meta)
        custom = spec_info.custom_mask if meta.masked else None
        _fill_masks(meta, custom)

    def forward_decode(self, q, k, v, out, layer_id, batch, scale) -> None:
        self._attend(q, out, layer_id, batch, scale)

    def forward_extend(self, q, k, v, out, layer_id, batch, scale) -> None:
        self._attend(q, out, layer_id, batch, scale)

    def _attend(self, q, out, layer_id, batch, scale) -> None:
        """``q [T, Hq, D]`` -> ``out [T, Hq, Dv]``, no host sync."""
        meta = self._current_metadata(q, batch)
        k_cache = self.kv_pool.k_buffers[layer_id]
        v_cache = self.kv_pool.v_buffers[layer_id]
        bs, width = meta.bs, meta.max_q_len
        num_kv_heads, head_dim = k_cache.shape[1], q.shape[2]
        group = q.shape[1] // num_kv_heads
        rows = q if meta.q_rows is None else q.index_select(0, meta.q_rows)
        # [bs, S, Hkv, G, D]: grouped heads attend one kv head without repeating it.
        qg = rows.float().view(bs, width, num_kv_heads, group, head_dim)
        keys = k_cache[meta.page_table].float()  # [bs, W, Hkv, D]
        logits = torch.einsum("bshgd,bwhd->bhgsw", qg, keys) * scale
        hidden = meta.hidden[:, None, None]
        logits = logits.masked_fill(hidden, _MASKED)
        probs = torch.softmax(logits, dim=-1).masked_fill_(hidden, 0.0)
        vals = v_cache[meta.page_table].float()  # [bs, W, Hkv, Dv], a fresh gather
        vals.masked_fill_(meta.past_extent[:, :, None, None], 0.0)
        o = torch.einsum("bhgsw,bwhd->bshgd", probs, vals)
        o = o.reshape(bs * width, num_kv_heads * group, vals.shape[-1])
        if meta.token_src is not None:
            o = o.index_select(0, meta.token_src)
        out.copy_(o)


def _fill_ragged_rows(meta: TorchGraphMetadata) -> None:
    """Maps between the ragged token layout and the padded ``[bs, S]`` one;
    padded slots repeat a request's last row (masked, never read back)."""
    bs, width = meta.bs, meta.max_q_len
    i = torch.arange(width, device=meta.q_lens.device)
    last = (meta.q_lens.long() - 1).clamp_(min=0)
    rows = meta.qo_indptr[:bs, None].long() + torch.minimum(i[None, :], last[:, None])
    meta.q_rows.copy_(rows.reshape(-1).clamp_(0, max(meta.num_tokens - 1, 0)))
    t = torch.arange(meta.num_tokens, device=meta.q_lens.device)
    req = request_of_position(meta.qo_indptr, t)
    meta.token_src.copy_(req * width + (t - meta.qo_indptr[req]))


def _fill_masks(meta: TorchGraphMetadata, custom_mask: Optional[torch.Tensor]) -> None:
    """``past_extent[b, j]``: ``j >= kv_len``. ``hidden[b, i, j]``: key ``j``
    invisible to query ``i`` (causal at offset ``kv_len - q_len``, or off
    ``custom_mask``)."""
    bs, width, keys = meta.hidden.shape
    device = meta.hidden.device
    i = torch.arange(width, device=device).view(1, width, 1)
    j = torch.arange(keys, device=device).view(1, 1, keys)
    q_len = meta.q_lens.view(bs, 1, 1).long()
    kv_len = meta.kv_lens.view(bs, 1, 1).long()
    torch.ge(j[0], kv_len[:, 0], out=meta.past_extent)
    in_range = (i < q_len) & (j < kv_len)
    if custom_mask is None:
        torch.logical_not(in_range & (j <= kv_len - q_len + i), out=meta.hidden)
        return
    fill_mask_indptr(meta.mask_indptr, meta.q_lens, meta.kv_lens)
    flat_mask = custom_mask.reshape(-1)
    # Out-of-range (b, i, j) are clamped to a valid index and masked by in_range.
    flat = (meta.mask_indptr[:bs].view(bs, 1, 1) + i * kv_len + j).clamp_(0, max(flat_mask.numel() - 1, 0))
    torch.logical_not(flat_mask[flat].bool() & in_range, out=meta.hidden)
