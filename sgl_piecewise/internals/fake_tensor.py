"""Whether a tensor is one of torch.compile's fake tensors.

What it reads: ``torch._subclasses.fake_tensor.is_fake``, private. Why: a
plain ``meta`` tensor reaches a custom op's fake implementation as a fake
tensor does, and only the plain one must be checked against the KV pool
(``ops/attention.py``): a trace must not read the forward context.

Written against torch 2.11-2.13. Fallback where it is missing: every tensor
counts as fake, so the fake implementation checks nothing against the pool
(a plain ``meta`` call is then not refused: the behaviour of a torch
without this check).
"""

from __future__ import annotations

import torch

TORCH_VERSIONS = ("2.11", "2.13")  # written against

try:
    from torch._subclasses.fake_tensor import is_fake as _is_fake
except ImportError:  # pragma: no cover - a torch without it
    _is_fake = None

AVAILABLE: bool = _is_fake is not None
UNAVAILABLE_REASON: str = "" if AVAILABLE else f"torch {torch.__version__} has no torch._subclasses.fake_tensor.is_fake"


def is_fake(t: torch.Tensor) -> bool:
    """True for a fake tensor, and for every tensor where this torch cannot tell."""
    return _is_fake(t) if AVAILABLE else True
