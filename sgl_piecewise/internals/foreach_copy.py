"""``torch._foreach_copy_``: one launch copies a list of tensors, where
``copy_`` launches one per tensor (the registry's fills run before every
replay). Undocumented; written against torch 2.11-2.13. Fallback: the caller
copies tensor by tensor, where this is unavailable or raises (CUDA has no
foreach kernel for some dtypes).
"""

from __future__ import annotations

from typing import List

import torch

TORCH_VERSIONS = ("2.11", "2.13")  # written against; others are only checked for what is used
AVAILABLE: bool = hasattr(torch, "_foreach_copy_")
UNAVAILABLE_REASON: str = "" if AVAILABLE else f"torch {torch.__version__}: no torch._foreach_copy_"


def foreach_copy_(dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
    """Copy each of ``srcs`` into its ``dsts`` in one launch; raises where it cannot."""
    if not AVAILABLE:
        raise NotImplementedError(UNAVAILABLE_REASON)
    torch._foreach_copy_(dsts, srcs)
