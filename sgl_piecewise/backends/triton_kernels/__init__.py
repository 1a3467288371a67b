"""Triton attention kernels over the paged KV pool (needs ``triton``).

``decode_attention`` (split-KV, grouped query heads) and ``extend_attention``
(causal-with-offset or custom-mask prefill over prefix + new keys) write into
caller-provided outputs, never synchronise with the host and launch grids that
depend only on Python ints, so both can be captured in a CUDA graph.
Without a GPU, run them under ``TRITON_INTERPRET=1`` (set before import).

Decode, with scratch allocated once for the largest batch::

    logits = torch.empty(max_bs, Hq, DEFAULT_MAX_KV_SPLITS, Dv, dtype=torch.float32, device=dev)
    lse = torch.empty(max_bs, Hq, DEFAULT_MAX_KV_SPLITS, dtype=torch.float32, device=dev)
    splits = torch.empty(max_bs, dtype=torch.int32, device=dev)
    choose_num_kv_splits(kv_lens, DEFAULT_MAX_KV_SPLITS, splits[:bs])
    decode_attention(q, k_cache, v_cache, out, kv_indptr, kv_indices, logits, lse,
                     splits[:bs], DEFAULT_MAX_KV_SPLITS, head_dim ** -0.5)
"""

from sgl_piecewise.backends.triton_kernels.decode import (
    DEFAULT_MAX_KV_SPLITS,
    choose_num_kv_splits,
    decode_attention,
)
from sgl_piecewise.backends.triton_kernels.extend import extend_attention

__all__ = ["DEFAULT_MAX_KV_SPLITS", "choose_num_kv_splits", "decode_attention", "extend_attention"]
