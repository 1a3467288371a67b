"""What a custom Dynamo backend needs and torch 2.11-2.13 offers only
privately: the trace's fake mode (``torch._guards``), the Python dispatcher
Dynamo traces under (``torch._dispatch.python``), another backend by name
(Dynamo's backend registry) and the graph-break exception. They bypass
nothing: they are how a backend plugs in. No fallback: a clear error.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Tuple, Type, Union

import torch

from sgl_piecewise.errors import SglPiecewiseError

TORCH_VERSIONS = ("2.11", "2.13")  # written against; others are only checked for what is used


def _find() -> Tuple[Any, Any, Any, Any, str]:
    missing, found = [], []
    for module, name in (
        ("torch._guards", "detect_fake_mode"),
        ("torch._dispatch.python", "enable_python_dispatcher"),
        ("torch._dynamo.backends.registry", "lookup_backend"),
        ("torch._dynamo.exc", "Unsupported"),
    ):
        try:
            value = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            value = None
            missing.append(f"{module}.{name}")
        found.append(value)
    reason = f"torch {torch.__version__} has no {', '.join(missing)}" if missing else ""
    return (*found, reason)


_detect_fake_mode, _python_dispatcher, _lookup_backend, _unsupported, UNAVAILABLE_REASON = _find()
AVAILABLE: bool = not UNAVAILABLE_REASON

# What a fullgraph trace raises at a graph break (an empty tuple catches nothing).
GraphBreak: Union[Type[BaseException], Tuple[Type[BaseException], ...]] = (
    _unsupported if isinstance(_unsupported, type) else ()
)


def _require(fn: Any, what: str) -> Callable:
    if fn is None:
        raise SglPiecewiseError(f"sgl_piecewise backend: expected {what} in torch, got none ({UNAVAILABLE_REASON})")
    return fn


def detect_fake_mode() -> Any:
    return _require(_detect_fake_mode, "the tracing context's fake mode")()


def python_dispatcher() -> Any:
    """A context in which composite ops decompose as in Dynamo's trace,
    reading symbolic sizes as symbols (some C++ ones read ints, which fixes
    a dynamic size to the traced value)."""
    return _require(_python_dispatcher, "the Python dispatcher")()


def lookup_backend(name: str) -> Callable:
    return _require(_lookup_backend, "Dynamo's backend registry")(name)
