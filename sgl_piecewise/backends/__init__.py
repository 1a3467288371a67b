"""Attention backends: the contract (``base``), shared length helpers
(``lengths``) and implementations. ``reference`` is the oracle."""

from sgl_piecewise.backends.base import AttentionBackend
from sgl_piecewise.backends.reference import ReferenceBackend

__all__ = ["AttentionBackend", "ReferenceBackend"]
