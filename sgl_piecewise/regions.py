"""Repeated regions: the parts of a decoder layer between its attention calls,
which Dynamo can trace once and stamp out for every other layer.

A model's layers run the same code on their own weights, and Dynamo traces
every call again: 2.6 s for the 24 layers of the suite's 0.5b shape on a
CPU, 1.3 s with regions (docs/BENCHMARKS.md). A function marked
``@repeated_region`` is, while ``tracing_regions()`` is active
(``CompiledModel`` enters it around its trace) and the installed torch can
reuse a traced region, called through
``torch.compiler.nested_compile_region``: Dynamo traces its first call,
stamps that trace out for every later call whose inputs match it (the same
shapes, dtypes and modules of the same structure; weights are inputs), and
inlines every region back into one flat graph before the backend sees it
(``torch._dynamo.config.inline_invoke_subgraph``). The backend then gets the
graph it got without regions: the same ops in the same order.

Everywhere else (eager, another compiler, a torch whose Dynamo re-traces
every region call) the function runs as written. A torch has the reuse when
it has ``torch._dynamo.variables.invoke_subgraph`` (Dynamo's subgraph
reuse, upstream PyTorch PR 176644) and the inlining pass; 2.13 has both,
2.11 no subgraph reuse.

A region must see everything that differs between its calls through its
arguments: a value it reads from a module that differs per layer (the
attention's ``layer_id``) would be guarded on, fail the reuse and trace the
call again. So the attention call, which names its layer, stays outside.
Its outputs must not alias each other (Dynamo refuses such a region).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import threading
from typing import Callable, Iterator, TypeVar

import torch

from sgl_piecewise.errors import InvalidTypeError

F = TypeVar("F", bound=Callable)

# ``on``: inside tracing_regions() on this thread. Per thread: another
# thread's trace (a model compiled with Dynamo's guards kept) is not switched.
_state = threading.local()


@torch.compiler.assume_constant_result
def _tracing_regions() -> bool:
    """Read by Dynamo as a constant, with no guard on it: a guard on a global
    would keep the graph from being called without Dynamo (``direct_call.py``)."""
    return getattr(_state, "on", False)


@functools.lru_cache(maxsize=None)
def regions_available() -> bool:
    """Whether this torch traces a marked region once and reuses the trace,
    and can inline the regions back into a flat graph."""
    if importlib.util.find_spec("torch._dynamo.variables.invoke_subgraph") is None:
        return False
    import torch._dynamo

    return hasattr(torch._dynamo.config, "inline_invoke_subgraph")


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
    """Trace marked regions once each inside this block, where torch can
    (yields whether it does); a no-op elsewhere."""
    if not regions_available() or _tracing_regions():
        yield _tracing_regions()
        return
    import torch._dynamo

    _state.on = True
    try:
        with torch._dynamo.config.patch(inline_invoke_subgraph=True):
            yield True
    finally:
        _state.on = False
