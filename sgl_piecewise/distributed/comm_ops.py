"""The tensor-parallel collectives as out-of-place custom ops (namespace
``sgl_piecewise``): ``all_reduce``, ``all_gather`` (along ``dim``, rank
order) and ``reduce_scatter`` (this rank's share of dim 0). Out of place
keeps Inductor's graph functional; the fake implementations let Dynamo trace
each call as one node; the group is found by name (``registry.py``); the
real ones run inside CUDA graphs.

An all-reduce takes, alike on every rank: the one-shot symmetric-memory op
up to :data:`ONE_SHOT_MAX_BYTES`, the two-shot one up to
:data:`SMALL_ALL_REDUCE_MAX_BYTES` (where the buffer fits), else NCCL.
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

# Where each path is fastest inside CUDA graphs (docs/BENCHMARKS.md).
ONE_SHOT_MAX_BYTES = 1 << 20
SMALL_ALL_REDUCE_MAX_BYTES = 8 << 20

# torch 2.13's names, else 2.11's (both public, the same arguments).
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_nccl_only = False


@contextlib.contextmanager
def nccl_only_all_reduces() -> Iterator[None]:
    """All-reduces in the body go through NCCL (to compare the paths: a graph
    keeps the path it was captured with). Enter it on every rank alike."""
    global _nccl_only
    saved, _nccl_only = _nccl_only, True
    try:
        yield
    finally:
        _nccl_only = saved


def nccl_only() -> bool:
    return _nccl_only


def symmetric_path(x: torch.Tensor, group_name: str) -> Optional[str]:
    """``"one_shot"``, ``"two_shot"`` or None (NCCL) for an all-reduce of ``x``."""
    nbytes = x.numel() * x.element_size()
    if _nccl_only or not symm_mem.AVAILABLE or nbytes > SMALL_ALL_REDUCE_MAX_BYTES:
        return None
    buffer = registry.symmetric_buffer(group_name)
    if buffer is None or not symm_mem.fits(x, buffer):
        return None
    return "two_shot" if nbytes > ONE_SHOT_MAX_BYTES and symm_mem.TWO_SHOT else "one_shot"


def uses_symmetric_memory(x: torch.Tensor, group_name: str) -> bool:
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
    stacked = x.new_empty((world_size,) + tuple(x.shape))
    _gather_into(stacked.view(-1), x.contiguous().view(-1), group=group)
    if math.prod(x.shape[:dim]) == 1:  # the ranks' blocks already lie in order along dim
        return stacked.view(_gathered_shape(x, dim, world_size))
    # One concatenation: a vectorised copy, faster than reshaping the moved dims.
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
    """Dim 0 must split evenly (``torch._check`` for a symbolic size)."""
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
