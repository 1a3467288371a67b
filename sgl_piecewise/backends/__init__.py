"""Attention backends: the contract (``base``), ``reference`` (the oracle)
and the graph-capable ones; ``factory`` imports Triton and FlashInfer only
when named."""

from sgl_piecewise.backends.base import AttentionBackend, BackendUnavailableError
from sgl_piecewise.backends.composite import CompositeBackend
from sgl_piecewise.backends.factory import backend_names, create_backend, get_backend_class
from sgl_piecewise.backends.reference import ReferenceBackend
from sgl_piecewise.backends.torch_graph import TorchGraphBackend

__all__ = [
    "AttentionBackend",
    "BackendUnavailableError",
    "CompositeBackend",
    "ReferenceBackend",
    "TorchGraphBackend",
    "backend_names",
    "create_backend",
    "get_backend_class",
]
