"""The ``sgl_piecewise`` Dynamo backend: graph splitting around attention,
piece compilers, per-piece CUDA graphs, options and counters."""

from sgl_piecewise.compile.backend import SglPiecewiseBackend, sgl_piecewise_backend
from sgl_piecewise.compile.compiled_model import CompiledModel, mark_token_axis
from sgl_piecewise.compile.options import CompileOptions, default_capture_sizes
from sgl_piecewise.compile.split import register_splitting_op
from sgl_piecewise.graphs.counters import counters

__all__ = [
    "CompileOptions",
    "CompiledModel",
    "SglPiecewiseBackend",
    "counters",
    "default_capture_sizes",
    "mark_token_axis",
    "register_splitting_op",
    "sgl_piecewise_backend",
]
