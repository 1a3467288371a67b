"""Attention backends: the contract (``base``), shared length helpers
(``lengths``), graph metadata helpers (``metadata``), the Pattern A base
class of graph-capable backends (``static_graph``) and implementations.
``reference`` is the oracle. ``factory`` builds a backend by name; the Triton
and FlashInfer backends are imported only when named, since their
dependencies are optional."""

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
