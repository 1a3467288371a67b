"""sgl_piecewise: CUDA graphs and torch.compile for LLM forward passes.

``import sgl_piecewise`` registers the ``sgl_piecewise::*`` custom ops.
"""

from sgl_piecewise import ops
from sgl_piecewise.context import forward_context
from sgl_piecewise.errors import (
    InvalidInputError,
    KVPoolExhaustedError,
    NoForwardContextError,
    SglPiecewiseError,
    StaleGraphError,
    UnsupportedModeError,
)
from sgl_piecewise.forward import ForwardBatch, ForwardMode, SpecInfo
from sgl_piecewise.memory import KVPool, ReqToTokenPool
from sgl_piecewise.version import __version__

__all__ = [
    "__version__",
    "ForwardBatch",
    "ForwardMode",
    "InvalidInputError",
    "KVPool",
    "KVPoolExhaustedError",
    "NoForwardContextError",
    "ReqToTokenPool",
    "SglPiecewiseError",
    "SpecInfo",
    "StaleGraphError",
    "UnsupportedModeError",
    "forward_context",
    "ops",
]


def _register_dynamo_backend() -> None:
    """Make ``backend="sgl_piecewise"`` work without an installed entry point
    (a source checkout). An installed package is registered by torch through
    its ``torch_dynamo_backends`` entry point, and a second registration of the
    name would fail."""
    if _installed_entry_point():
        return
    from torch._dynamo import register_backend

    from sgl_piecewise.compile.backend import sgl_piecewise_backend

    register_backend(sgl_piecewise_backend, name="sgl_piecewise")


def _installed_entry_point() -> bool:
    from importlib import metadata

    try:
        entry_points = metadata.distribution("sgl_piecewise").entry_points
    except metadata.PackageNotFoundError:
        return False
    return any(ep.group == "torch_dynamo_backends" and ep.name == "sgl_piecewise" for ep in entry_points)


_register_dynamo_backend()
