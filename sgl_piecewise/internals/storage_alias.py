"""A tensor over another's memory that does not keep it allocated
(``torch._C._construct_storage_from_data_pointer``; torch 2.11-2.13), so a
graph pool holds one captured size's outputs, not every size's. Fallback:
an ordinary alias, which keeps the memory.
"""

from __future__ import annotations

import torch

TORCH_VERSIONS = ("2.11", "2.13")  # written against; others are only checked for what is used

_construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
AVAILABLE: bool = callable(_construct)
UNAVAILABLE_REASON: str = (
    "" if AVAILABLE else f"torch {torch.__version__} has no torch._C._construct_storage_from_data_pointer"
)


def non_owning_alias(t: torch.Tensor) -> torch.Tensor:
    """``t``'s view over memory it does not keep alive (where this torch can)."""
    storage = t.untyped_storage()
    if AVAILABLE:
        storage = _construct(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())
