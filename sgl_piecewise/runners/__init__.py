"""Graph runners: whole-model (``CudaGraphRunner``), piecewise and breakable,
and ``dispatch``, the graph policies and the routing of every step."""

from sgl_piecewise.runners.breakable import BreakableCudaGraphRunner
from sgl_piecewise.runners.dispatch import POLICIES, CaptureReport
from sgl_piecewise.runners.piecewise import PiecewiseCudaGraphRunner
from sgl_piecewise.runners.whole_model import CudaGraphRunner

__all__ = ["POLICIES", "BreakableCudaGraphRunner", "CaptureReport", "CudaGraphRunner", "PiecewiseCudaGraphRunner"]
