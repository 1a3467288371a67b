"""Dynamo backend, graph splitting, piece compilers, buffer registry, CUDA graph runners."""

from sgl_piecewise.compile.backend import SglPiecewiseBackend, sgl_piecewise_backend
from sgl_piecewise.compile.counters import counters
from sgl_piecewise.compile.options import CompileOptions, default_capture_sizes
from sgl_piecewise.compile.split import register_splitting_op

__all__ = [
    "CompileOptions",
    "SglPiecewiseBackend",
    "counters",
    "default_capture_sizes",
    "register_splitting_op",
    "sgl_piecewise_backend",
]
