"""Triton attention kernels over the paged KV pool (needs ``triton``; without
a GPU, set ``TRITON_INTERPRET=1`` before import). Both write into
caller-provided outputs without a host sync, so they can be captured.
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
