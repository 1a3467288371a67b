"""Two private calls into torch's CUDA state for the capture core, written
against torch 2.11-2.13. ``torch._C._cuda_clearCublasWorkspaces`` before a
capture puts its cuBLAS workspace in the graph pool (cudagraph trees free
workspaces held outside it); fallback: skipped, with a warning.
``torch._C._cuda_endAllocateToPool`` closes a pool after a capture CUDA
refused to end; fallback: skipped, the pool's memory stays reserved.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("sgl_piecewise.graphs")

TORCH_VERSIONS = ("2.11", "2.13")  # written against; others are only checked for what is used

_clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
_end = getattr(torch._C, "_cuda_endAllocateToPool", None)
_missing = [
    name
    for name, fn in (("_cuda_clearCublasWorkspaces", _clear), ("_cuda_endAllocateToPool", _end))
    if not callable(fn)
]
AVAILABLE: bool = not _missing  # a build without CUDA has neither
UNAVAILABLE_REASON: str = (
    "" if AVAILABLE else f"torch {torch.__version__} has no torch._C.{', torch._C.'.join(_missing)}"
)
_warned = False


def clear_cublas_workspaces() -> None:
    global _warned
    if AVAILABLE:
        _clear()
        return
    if not _warned:
        _warned = True
        logger.warning(
            "CUDA graphs: cuBLAS workspaces not freed before capture (%s); a graph may keep a workspace "
            "allocated outside its pool, which is safe unless something in this process frees cuBLAS "
            "workspaces (torch.compile mode='reduce-overhead' does): do not mix the two",
            UNAVAILABLE_REASON,
        )


def end_allocate_to_pool(device_index: int, pool: tuple) -> None:
    if AVAILABLE:
        _end(device_index, pool)
