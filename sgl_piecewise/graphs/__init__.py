"""What every graph path shares, below the compiler and the runners.

* ``capture``: the capture core (one pool and one capture stream per device,
  warm-up, gc frozen, cuBLAS workspaces in the pool, largest size first);
* ``graph_slot``, ``buffer_registry``, ``input_registries``: the declared
  static inputs of every graph, filled the same way at capture and replay;
* ``weight_guard``: the weights a graph read at capture, checked at replay;
* ``fill_graphs``: a graph-capable backend's metadata fill, recorded once;
* ``counters``: what was split, compiled, captured and replayed, and why not.
"""

from sgl_piecewise.graphs.buffer_registry import CudaGraphBufferRegistry
from sgl_piecewise.graphs.capture import GraphCapture, shared_capture
from sgl_piecewise.graphs.counters import counters

__all__ = ["CudaGraphBufferRegistry", "GraphCapture", "counters", "shared_capture"]
