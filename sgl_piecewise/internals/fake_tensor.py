"""Whether a tensor is a torch.compile fake tensor
(``torch._subclasses.fake_tensor.is_fake``; torch 2.11-2.13), so only a
plain ``meta`` call is checked against the KV pool. Fallback: all count as fake.
"""

from __future__ import annotations

import torch

TORCH_VERSIONS = ("2.11", "2.13")

try:
    from torch._subclasses.fake_tensor import is_fake as _is_fake
except ImportError:  # pragma: no cover
    _is_fake = None

AVAILABLE: bool = _is_fake is not None
UNAVAILABLE_REASON: str = "" if AVAILABLE else f"torch {torch.__version__} has no torch._subclasses.fake_tensor.is_fake"


def is_fake(t: torch.Tensor) -> bool:
    return _is_fake(t) if AVAILABLE else True
