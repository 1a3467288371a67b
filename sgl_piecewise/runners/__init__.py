"""Graph runners, above the compiler and the shared graph machinery.

* ``whole_model``: ``CudaGraphRunner``, one graph per mode (DECODE,
  TARGET_VERIFY, DRAFT_EXTEND_V2, IDLE; ``graph_modes``) and batch size,
  attention inside;
* ``piecewise``: ``PiecewiseCudaGraphRunner``, the compiled model's pieces
  captured per token count, attention eager between them;
* ``breakable``: ``BreakableCudaGraphRunner``, the eager model captured per
  token count in segments broken at every attention call, no compiler;
* ``dispatch``: the graph policies of ``ModelRunner(graphs=...)``, their
  capture, and the routing of every step to the fastest path that serves it.
"""

from sgl_piecewise.runners.breakable import BreakableCudaGraphRunner
from sgl_piecewise.runners.dispatch import POLICIES, CaptureReport
from sgl_piecewise.runners.piecewise import PiecewiseCudaGraphRunner
from sgl_piecewise.runners.whole_model import CudaGraphRunner

__all__ = ["POLICIES", "BreakableCudaGraphRunner", "CaptureReport", "CudaGraphRunner", "PiecewiseCudaGraphRunner"]
