"""Attention backends by name, imported on first use: a missing optional
dependency fails only for its name, saying how to install it."""

from __future__ import annotations

import importlib
from typing import Dict, Optional, Tuple, Type

from sgl_piecewise.backends.base import AttentionBackend, BackendUnavailableError
from sgl_piecewise.errors import InvalidInputError

# name -> (module, class). Order: the oracle first, then graph-capable ones.
_BACKENDS: Dict[str, Tuple[str, str]] = {
    "reference": ("sgl_piecewise.backends.reference", "ReferenceBackend"),
    "torch": ("sgl_piecewise.backends.torch_graph", "TorchGraphBackend"),
    "triton": ("sgl_piecewise.backends.triton_backend", "TritonBackend"),
    "flashinfer": ("sgl_piecewise.backends.flashinfer_backend", "FlashInferBackend"),
}


def backend_names() -> Tuple[str, ...]:
    return tuple(_BACKENDS)


def get_backend_class(name: str) -> Type[AttentionBackend]:
    """The class registered as ``name``; imports its module now."""
    if name not in _BACKENDS:
        raise InvalidInputError(f"attention backend: expected one of {list(_BACKENDS)}, got {name!r}")
    module_name, class_name = _BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"attention backend {name!r}: expected its dependencies to import, got "
            f"ImportError ({exc}); install them with `pip install sgl_piecewise[gpu]`"
        ) from exc
    return getattr(module, class_name)


def create_backend(
    name: str,
    req_to_token_pool,
    kv_pool,
    num_q_heads: Optional[int] = None,
    **options,
) -> AttentionBackend:
    """Build backend ``name`` over the pools; ``options`` go to its class."""
    return get_backend_class(name)(req_to_token_pool, kv_pool, num_q_heads, **options)
