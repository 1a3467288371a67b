"""Repeated regions: the parts of a decoder layer between its attention calls,
which Dynamo traces once and stamps out for every other layer. A function
marked ``@repeated_region`` goes through ``nested_compile_region`` inside
``tracing_regions()`` where torch can (``internals/region_reuse.py``); the
regions are inlined back, so the backend gets the same flat graph.
Elsewhere it runs as written. A region sees what differs between layers
through its arguments only, so the attention call, which names its layer,
stays outside.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Iterator, TypeVar

import torch

from sgl_piecewise.errors import InvalidTypeError
from sgl_piecewise.internals import region_reuse

F = TypeVar("F", bound=Callable)

# ``on``: inside tracing_regions() on this thread (another thread's trace is not switched).
_state = threading.local()


@torch.compiler.assume_constant_result
def _tracing_regions() -> bool:
    """Read by Dynamo as a constant, unguarded, so the graph can be called without Dynamo."""
    return getattr(_state, "on", False)


def regions_available() -> bool:
    return region_reuse.AVAILABLE


def repeated_region(fn: F) -> F:
    """Mark ``fn`` as a region repeated with the same code in every layer."""
    if not callable(fn):
        raise InvalidTypeError(f"repeated_region: expected a function or method, got {fn!r}")
    # Wrapped once, at import: every call then names the same region.
    region = torch.compiler.nested_compile_region(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return region(*args, **kwargs) if _tracing_regions() else fn(*args, **kwargs)

    return call  # type: ignore[return-value]


@contextlib.contextmanager
def tracing_regions() -> Iterator[bool]:
    """Trace marked regions once each inside this block where torch can (yields whether it does)."""
    if not regions_available() or _tracing_regions():
        yield _tracing_regions()
        return
    _state.on = True
    try:
        with region_reuse.inlined_regions():
            yield True
    finally:
        _state.on = False
