"""What a custom Dynamo backend needs from Dynamo and torch offers only
privately.

* :func:`detect_fake_mode` (``torch._guards.detect_fake_mode``): the fake
  mode of the trace being compiled. Dynamo hands the backend fake tensors
  of its own mode; converting the real example inputs in that mode returns
  them, symbolic sizes included (``compile/backend.py``). Every backend that
  looks at shapes does this, Inductor's included.
* :func:`lookup_backend` (``torch._dynamo.backends.registry.lookup_backend``):
  another registered backend, by name (the ``tensorrt`` piece compiler
  compiles each piece with Torch-TensorRT's Dynamo backend).
* :data:`GraphBreak` (``torch._dynamo.exc.Unsupported``): what a
  ``fullgraph=True`` trace raises at a graph break, which ``CompiledModel``
  turns into an error naming the break's cause and place.

These bypass nothing and pay on no figure: they are how a backend plugs
in, with no public equivalent in torch 2.11-2.13 (written against those).
:data:`AVAILABLE` says at import whether all three are there. Without the
fake mode or the backend registry there is no fallback: the call raises
``SglPiecewiseError`` naming what is missing. Without ``Unsupported``,
:data:`GraphBreak` catches nothing and a graph break surfaces as Dynamo's
own error.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Tuple, Type, Union

import torch

from sgl_piecewise.errors import SglPiecewiseError

TORCH_VERSIONS = ("2.11", "2.13")  # written against; others are only checked for what is used


def _find() -> Tuple[Any, Any, Any, str]:
    missing, found = [], []
    for module, name in (
        ("torch._guards", "detect_fake_mode"),
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


_detect_fake_mode, _lookup_backend, _unsupported, UNAVAILABLE_REASON = _find()
AVAILABLE: bool = not UNAVAILABLE_REASON

# The exception (or exceptions) a fullgraph trace raises at a graph break;
# an empty tuple, which an ``except`` clause catches nothing with, where
# this torch has none.
GraphBreak: Union[Type[BaseException], Tuple[Type[BaseException], ...]] = (
    _unsupported if isinstance(_unsupported, type) else ()
)


def _require(fn: Any, what: str) -> Callable:
    if fn is None:
        raise SglPiecewiseError(f"sgl_piecewise backend: expected {what} in torch, got none ({UNAVAILABLE_REASON})")
    return fn


def detect_fake_mode() -> Any:
    """The fake mode of the trace being compiled (call inside a backend)."""
    return _require(_detect_fake_mode, "the tracing context's fake mode")()


def lookup_backend(name: str) -> Callable:
    """The Dynamo backend registered under ``name``."""
    return _require(_lookup_backend, "Dynamo's backend registry")(name)
