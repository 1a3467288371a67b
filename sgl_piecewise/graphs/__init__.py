"""What every graph path shares: the capture core, the graphs' static
inputs, the weight guard, recorded metadata fills and the counters."""

from sgl_piecewise.graphs.buffer_registry import CudaGraphBufferRegistry
from sgl_piecewise.graphs.capture import GraphCapture, shared_capture
from sgl_piecewise.graphs.counters import counters

__all__ = ["CudaGraphBufferRegistry", "GraphCapture", "counters", "shared_capture"]
