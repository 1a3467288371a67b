"""Tensor parallelism: the group of ranks (:class:`TensorParallel`,
:func:`init_tensor_parallel` from torchrun's environment), its collectives
as custom ops that Dynamo traces and CUDA graphs capture (``comm_ops.py``),
the symmetric memory :func:`prepare_communication` allocates before any
capture, and :func:`launch` to run a function on local ranks.
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
