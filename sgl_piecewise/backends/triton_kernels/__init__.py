"""Triton attention kernels over the paged KV pool (needs ``triton``).

``decode_attention`` (split-KV, grouped query heads) and ``extend_attention``
(causal-with-offset or custom-mask prefill over prefix + new keys) write into
caller-provided outputs, never synchronise with the host and launch grids that
depend only on Python ints, so both can be captured in a CUDA graph.
Without a GPU, run them under ``TRITON_INTERPRET=1`` (set before import).

Decode: the scratch's split axis is the grid's, which depends on the batch
size (small batches split keys more to fill the card)::

    S = grid_kv_splits(bs, Hq, Hkv, q.dtype, DEFAULT_MAX_KV_SPLITS, q.device, head_dim=D)
    logits = torch.empty(bs, Hq, S, D, dtype=torch.float32, device=dev)
    lse = torch.empty(bs, Hq, S, dtype=torch.float32, device=dev)
    counts = torch.zeros(bs, Hq, dtype=torch.int32, device=dev)  # every launch leaves it zero
    splits = choose_num_kv_splits(kv_lens, DEFAULT_MAX_KV_SPLITS, torch.empty_like(kv_lens))
    decode_attention(q, k_cache, v_cache, out, kv_indptr, kv_indices, logits, lse, counts,
                     splits, DEFAULT_MAX_KV_SPLITS, D ** -0.5)
"""

from sgl_piecewise.backends.triton_kernels.decode import (
    DEFAULT_MAX_KV_SPLITS,
    DecodeLaunch,
    choose_num_kv_splits,
    decode_attention,
    grid_kv_splits,
)
from sgl_piecewise.backends.triton_kernels.extend import ExtendPlan, extend_attention
from sgl_piecewise.backends.triton_kernels.metadata_fill import fill_paged_metadata

__all__ = [
    "DEFAULT_MAX_KV_SPLITS",
    "DecodeLaunch",
    "ExtendPlan",
    "choose_num_kv_splits",
    "decode_attention",
    "extend_attention",
    "fill_paged_metadata",
    "grid_kv_splits",
]
