"""A tensor over another tensor's memory that does not keep it allocated.

What it bypasses: a tensor always owns a reference to its storage, and a
storage keeps its allocation until the last reference goes. Private
``torch._C._construct_storage_from_data_pointer(ptr, device, nbytes)``
builds a storage over a raw address that owns nothing (no deleter), and
:func:`non_owning_alias` sets a new tensor on it with the original's
offset, shape and strides.

Why: a captured CUDA graph's outputs live in the shared graph pool
(``graphs/capture.py``), and their holder returns them at every replay: the
piecewise graphs keep each piece's outputs per captured size
(``compile/piece_graphs.py``), the breakable runner keeps the tensors each
attention call reads and writes, and its final output
(``runners/breakable.py``). Held by ordinary tensors, every size's outputs
would stay allocated for the life of the graphs, and no later (smaller)
size could reuse that memory: the pool would hold the outputs of every
captured size at once instead of the largest size's. Not owning them is
safe because replays of two sizes never interleave within one forward and
the top level copies the final outputs out before the next one. The figure
it pays on is the graph pool's size: for the 52 piecewise sizes (1-512
tokens) of the 0.5B shape, Inductor pieces, on an H200 with torch 2.11,
0.057 GiB with it and 1.94 GiB with the fallback below (34x; the same
tokens generated).

Written against torch 2.11-2.13. :data:`AVAILABLE` says at import whether
the call exists; it is read at every call, so a test sets it False to force
the fallback: an ordinary alias of the same storage (same memory, values,
offset, shape and strides), correct, but it keeps the memory allocated,
which costs the pool memory described above.
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
    """A tensor over ``t``'s memory (same offset, shape, strides, dtype) that
    does not keep the allocation alive; where this torch cannot make one, an
    alias that does (module docstring)."""
    storage = t.untyped_storage()
    if AVAILABLE:
        storage = _construct(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())
