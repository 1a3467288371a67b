"""Graph runners and what they share.

* ``capture``: the capture core (one pool and one capture stream per device,
  warm-up, gc frozen, cuBLAS workspaces in the pool, largest size first);
* ``graph_slot``, ``buffer_registry``, ``input_registries``: the declared
  static inputs of every graph, filled the same way at capture and replay;
* ``whole_model``: ``CudaGraphRunner``, one graph per mode (DECODE,
  TARGET_VERIFY, DRAFT_EXTEND_V2, IDLE; ``graph_modes``) and batch size,
  attention inside;
* ``piecewise``: ``PiecewiseCudaGraphRunner``, the compiled model's pieces
  captured per token count, attention eager between them;
* ``breakable``: ``BreakableCudaGraphRunner``, the eager model captured per
  token count in segments broken at every attention call, no compiler;
* ``dispatch``: the graph policies of ``ModelRunner(graphs=...)``, their
  capture, and the routing of every step to the fastest path that serves it.

Names are imported on first use: the compile backend imports the capture
core and the registry from here, and the piecewise runner imports the
compile backend.
"""

from importlib import import_module
from typing import Any

_PUBLIC = {
    "CudaGraphRunner": "sgl_piecewise.runners.whole_model",
    "PiecewiseCudaGraphRunner": "sgl_piecewise.runners.piecewise",
    "BreakableCudaGraphRunner": "sgl_piecewise.runners.breakable",
    "POLICIES": "sgl_piecewise.runners.dispatch",
    "CaptureReport": "sgl_piecewise.runners.dispatch",
    "GraphCapture": "sgl_piecewise.runners.capture",
    "shared_capture": "sgl_piecewise.runners.capture",
    "CudaGraphBufferRegistry": "sgl_piecewise.runners.buffer_registry",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_PUBLIC[name]), name)
