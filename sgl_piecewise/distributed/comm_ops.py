"""The tensor-parallel collectives as custom ops (``torch.library``,
namespace ``sgl_piecewise``):

* ``all_reduce(Tensor x, str group_name) -> Tensor``: the sum over the
  group's ranks;
* ``all_gather(Tensor x, int dim, int world_size, str group_name) -> Tensor``:
  every rank's ``x`` concatenated along ``dim``, in rank order;
* ``reduce_scatter(Tensor x, int world_size, str group_name) -> Tensor``:
  the sum over ranks, then this rank's ``1/world_size`` share of dim 0.

All three are out of place (``mutates_args=()``): an op that wrote into
its input would break the functional graph Inductor compiles. Each has a
fake implementation that gives the shape only, so Dynamo traces a model's
call as one node of the graph (``fullgraph=True`` holds; no graph break,
and the compile backend does not split there). The group is found by its
name (``registry.py``).

The real implementations run inside CUDA graphs: NCCL's ``all_reduce``,
all-gather and reduce-scatter can be captured, and nothing here syncs with
the host or keeps Python-side state per call; results are torch
allocations, which a capture takes from its pool.

All-reduce takes one of three paths, the same on every rank for a given
message (the choice reads only the message's size and dtype and state that
every rank set up alike):

* at most :data:`ONE_SHOT_MAX_BYTES`, where ``prepare_communication``
  allocated a symmetric-memory buffer large enough and the op takes the
  dtype: the one-shot all-reduce over that buffer
  (``internals/symm_mem.py``);
* above it and at most :data:`SMALL_ALL_REDUCE_MAX_BYTES`, the same way:
  the two-shot all-reduce where torch has it, else the one-shot;
* otherwise: ``torch.distributed.all_reduce`` (NCCL, gloo on the CPU) on a
  copy of the input.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from sgl_piecewise.distributed import registry
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.internals import symm_mem

# Where each path is fastest, measured inside CUDA graphs on two H200s
# (benchmarks/bench_all_reduce.py, docs/BENCHMARKS.md): one-shot up to
# 1 MiB (up to 8 us faster than NCCL at a few KiB, 1 us at 1 MiB); two-shot
# from 2 MiB to 8 MiB, the largest measured (21 / 30 / 46 us at 2 / 4 / 8 MiB
# against NCCL's 31 / 37 / 56). Larger messages go through NCCL.
ONE_SHOT_MAX_BYTES = 1 << 20
SMALL_ALL_REDUCE_MAX_BYTES = 8 << 20

# torch 2.13 deprecates the *_into_tensor / *_tensor names for the *_single
# ones; 2.11 has only the former. Both are public and take the same arguments.
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_nccl_only = False  # set by nccl_only_all_reduces()


@contextlib.contextmanager
def nccl_only_all_reduces() -> Iterator[None]:
    """All-reduces issued (or captured) in the body go through NCCL, even where
    a symmetric-memory buffer or a fused-norm workspace exists (the fused op
    then all-reduces, adds and normalises apart): to compare the paths (a
    graph keeps the path it was captured with). Enter it on every rank alike."""
    global _nccl_only
    saved, _nccl_only = _nccl_only, True
    try:
        yield
    finally:
        _nccl_only = saved


def nccl_only() -> bool:
    """Is :func:`nccl_only_all_reduces` active?"""
    return _nccl_only


def symmetric_path(x: torch.Tensor, group_name: str) -> Optional[str]:
    """The symmetric-memory op an all-reduce of ``x`` in this group takes:
    ``"one_shot"``, ``"two_shot"``, or None for NCCL (module docstring)."""
    nbytes = x.numel() * x.element_size()
    if _nccl_only or not symm_mem.AVAILABLE or nbytes > SMALL_ALL_REDUCE_MAX_BYTES:
        return None
    buffer = registry.symmetric_buffer(group_name)
    if buffer is None or not symm_mem.fits(x, buffer):
        return None
    return "two_shot" if nbytes > ONE_SHOT_MAX_BYTES and symm_mem.TWO_SHOT else "one_shot"


def uses_symmetric_memory(x: torch.Tensor, group_name: str) -> bool:
    """Does an all-reduce of ``x`` in this group go through symmetric memory?"""
    return symmetric_path(x, group_name) is not None


@torch.library.custom_op("sgl_piecewise::all_reduce", mutates_args=())
def _all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    group = registry.resolve_group(group_name)
    path = symmetric_path(x, group_name)
    if path == "one_shot":
        return symm_mem.one_shot_all_reduce(x, registry.symmetric_buffer(group_name), group_name)
    if path == "two_shot":
        return symm_mem.two_shot_all_reduce(x, registry.symmetric_buffer(group_name), group_name)
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


@_all_reduce.register_fake
def _all_reduce_fake(x, group_name):
    return x.new_empty(x.shape)


@torch.library.custom_op("sgl_piecewise::all_gather", mutates_args=())
def _all_gather(x: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    dim = _gather_dim(x, dim)
    group = registry.resolve_group(group_name)
    _check_group_size(group, world_size)
    # Gathered flat in rank order ([world_size, *x.shape]), then laid along dim.
    stacked = x.new_empty((world_size,) + tuple(x.shape))
    _gather_into(stacked.view(-1), x.contiguous().view(-1), group=group)
    if math.prod(x.shape[:dim]) == 1:  # the ranks' blocks already lie in order along dim
        return stacked.view(_gathered_shape(x, dim, world_size))
    # One concatenation: a vectorised copy, where reshaping the moved dims
    # copies element by element (32 rows of float32 logits at half of a
    # 128k vocabulary each: 6.5 against 11.6 us on an H200).
    return torch.cat(stacked.unbind(0), dim=dim)


@_all_gather.register_fake
def _all_gather_fake(x, dim, world_size, group_name):
    _check_world_size(world_size)
    return x.new_empty(_gathered_shape(x, _gather_dim(x, dim), world_size))


@torch.library.custom_op("sgl_piecewise::reduce_scatter", mutates_args=())
def _reduce_scatter(x: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    _check_scatterable(x, world_size)
    group = registry.resolve_group(group_name)
    _check_group_size(group, world_size)
    out = x.new_empty((x.shape[0] // world_size,) + tuple(x.shape[1:]))
    _reduce_scatter_into(out, x.contiguous(), group=group)
    return out


@_reduce_scatter.register_fake
def _reduce_scatter_fake(x, world_size, group_name):
    _check_scatterable(x, world_size)
    return x.new_empty((x.shape[0] // world_size,) + tuple(x.shape[1:]))


def _gathered_shape(x: torch.Tensor, dim: int, world_size: int) -> tuple:
    shape = list(x.shape)
    shape[dim] = shape[dim] * world_size
    return tuple(shape)


def _gather_dim(x: torch.Tensor, dim: int) -> int:
    """``dim`` as a non-negative index into ``x``'s dimensions."""
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise InvalidInputError(f"dim: expected a dimension of x (shape {list(x.shape)}), got {dim}")
    return dim % x.dim()


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidInputError(f"world_size: expected a positive int, got {world_size!r}")


def _check_group_size(group: "dist.ProcessGroup", world_size: int) -> None:
    _check_world_size(world_size)
    if group.size() != world_size:
        raise InvalidInputError(f"world_size: expected the group's size {group.size()}, got {world_size}")


def _check_scatterable(x: torch.Tensor, world_size: int) -> None:
    """Dim 0 must split evenly. A symbolic size (a trace with a dynamic token
    axis) is checked by ``torch._check``: a guard where the size is backed,
    a run-time assertion where it is not."""
    _check_world_size(world_size)
    if x.dim() == 0:
        raise InvalidInputError("x: expected at least one dimension to scatter, got a 0-d tensor")
    rows = x.shape[0]
    if isinstance(rows, int):
        if rows % world_size:
            raise InvalidInputError(
                f"x: expected dim 0 divisible by the group's size {world_size}, got shape {list(x.shape)}"
            )
        return
    torch._check(
        rows % world_size == 0,
        lambda: f"x: expected dim 0 divisible by the group's size {world_size}, got {rows}",
    )
