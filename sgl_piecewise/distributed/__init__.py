"""Tensor parallelism: the group of ranks, and its collectives as custom ops.

A model calls ``tp.all_reduce(x)``, ``tp.all_gather(x, dim)`` or
``tp.reduce_scatter(x)`` on its :class:`TensorParallel` (``tensor_parallel()``
by default): each is an out-of-place custom op (``comm_ops.py``) that
Dynamo traces without a graph break and a CUDA graph captures; at one rank
each returns its input. :func:`init_tensor_parallel` builds the group from
torchrun's environment; :func:`prepare_communication`, before any capture,
allocates the symmetric memory that makes small all-reduces one kernel
(one-shot, or two-shot for the larger of them);
:func:`launch` runs a function on several local ranks (tests, benchmarks).
"""

from sgl_piecewise.distributed.comm_ops import (
    ONE_SHOT_MAX_BYTES,
    SMALL_ALL_REDUCE_MAX_BYTES,
    nccl_only_all_reduces,
)
from sgl_piecewise.distributed.groups import (
    SAFE_ENV,
    TensorParallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
    prepare_communication,
    symmetric_buffer_bytes,
    tensor_parallel,
    track_graph,
)
from sgl_piecewise.distributed.launch import LaunchTimeoutError, RankFailedError, launch

__all__ = [
    "ONE_SHOT_MAX_BYTES",
    "SAFE_ENV",
    "SMALL_ALL_REDUCE_MAX_BYTES",
    "LaunchTimeoutError",
    "RankFailedError",
    "TensorParallel",
    "destroy_tensor_parallel",
    "init_tensor_parallel",
    "launch",
    "nccl_only_all_reduces",
    "prepare_communication",
    "symmetric_buffer_bytes",
    "tensor_parallel",
    "track_graph",
]
