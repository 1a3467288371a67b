"""sgl_piecewise: CUDA graphs and torch.compile for LLM forward passes.

``import sgl_piecewise`` registers the ``sgl_piecewise::*`` custom ops.
"""

from sgl_piecewise import ops
from sgl_piecewise.errors import (
    InvalidInputError,
    KVPoolExhaustedError,
    NoForwardContextError,
    SglPiecewiseError,
    UnsupportedModeError,
)
from sgl_piecewise.forward import ForwardBatch, ForwardMode, SpecInfo, forward_context
from sgl_piecewise.memory import KVPool, ReqToTokenPool

__version__ = "0.1.0"

__all__ = [
    "ForwardBatch",
    "ForwardMode",
    "InvalidInputError",
    "KVPool",
    "KVPoolExhaustedError",
    "NoForwardContextError",
    "ReqToTokenPool",
    "SglPiecewiseError",
    "SpecInfo",
    "UnsupportedModeError",
    "forward_context",
    "ops",
]


def _register_dynamo_backend() -> None:
    """Make ``backend="sgl_piecewise"`` work after ``import sgl_piecewise`` even
    without an installed entry point (e.g. a source checkout on PYTHONPATH)."""
    from torch._dynamo.backends import registry

    if "sgl_piecewise" not in registry._COMPILER_FNS:
        from sgl_piecewise.compile.backend import sgl_piecewise_backend

        registry.register_backend(sgl_piecewise_backend, "sgl_piecewise")


_register_dynamo_backend()
