"""Two calls into torch's CUDA state that ``torch.cuda`` does not expose,
made by the capture core (``graphs/capture.py``).

:func:`clear_cublas_workspaces` (private ``torch._C._cuda_clearCublasWorkspaces``)
frees the cuBLAS workspace torch keeps per (handle, stream), so the next
matmul allocates a new one. The capture core calls it right before each
capture, so the capture allocates its workspace inside the graph pool.
Why: a workspace allocated outside the pool (by the warm-up, on the same
stream) is baked into the graph, but torch.compile's ``reduce-overhead``
(cudagraph trees) frees every workspace before it records; the graph's
matmuls then write their scratch into memory someone else owns (an illegal
address on an H200, after a ``reduce-overhead`` compile in the same
process). This pays on correctness, not speed: it is what
``tests/test_whole_model_runner.py::test_gpu_decode_graphs_keep_their_cublas_workspace_in_their_pool``
checks. torch.cudagraph trees make the same call for the same reason.

Fallback (:data:`AVAILABLE` False): the call is skipped, with a warning
logged once. A graph then keeps the workspace its warm-up allocated, outside
the pool. That is safe as long as nothing in the process frees cuBLAS
workspaces: torch holds each one until ``_cuda_clearCublasWorkspaces`` is
called, and (in 2.11-2.13) only cudagraph trees (``mode="reduce-overhead"``
or ``"max-autotune"``) and torch's own test harness call it. A process that
also runs those must not use the fallback: the warning says so. Setting
``CUBLAS_WORKSPACE_CONFIG=:0:0`` (no workspace at all) would also be safe,
but it is read once, when cuBLAS first runs, so a library cannot set it in
time, and it slows some matmuls for the whole process; it is left to the
user.

:func:`end_allocate_to_pool` (private ``torch._C._cuda_endAllocateToPool``)
tells the caching allocator that a capture into a pool is over, where
torch did not: when CUDA refuses to end an invalidated capture,
``CUDAGraph.capture_end`` raises before it tells the allocator, and the
pool refuses every later capture ("already recording to mempool_id"). The
capture core captures into a new pool from then on and keeps the old one
alive for the graphs in it; this call only closes the old pool's record.
Fallback: skipped. Graphs still capture (into the new pool) and replay
right, but the caching allocator then believes a capture is still under way
for the rest of the process, and ``torch.cuda.empty_cache()`` stops
returning memory: on an H200 with torch 2.11, a later capture phase's
128 MiB warm-up scratch stayed reserved outside the pool after
``release_scratch``, which returns it with the call. That costs memory only
in a process that goes on after a capture CUDA refused to end (which raised
an error already). The figure it pays on: the memory ``release_scratch``
returns after such a failure.

Written against torch 2.11-2.13. :data:`AVAILABLE` is checked at import
(both calls present; a build without CUDA lacks the first) and read at
every call, so a test sets it False to force the fallbacks.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("sgl_piecewise.graphs")

TORCH_VERSIONS = ("2.11", "2.13")  # written against; others are only checked for what is used

_clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
_end = getattr(torch._C, "_cuda_endAllocateToPool", None)
_missing = [name for name, fn in (("_cuda_clearCublasWorkspaces", _clear), ("_cuda_endAllocateToPool", _end))
            if not callable(fn)]  # fmt: skip
AVAILABLE: bool = not _missing
# A build without CUDA has no _cuda_clearCublasWorkspaces (and captures nothing).
UNAVAILABLE_REASON: str = (
    "" if AVAILABLE else f"torch {torch.__version__} has no torch._C.{', torch._C.'.join(_missing)}"
)
_warned = False


def clear_cublas_workspaces() -> None:
    """Free cuBLAS's workspaces, so the next capture allocates its own in
    its pool; where this torch cannot, warn once and skip (module docstring)."""
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
    """Tell the caching allocator that capturing into ``pool`` on the device
    is over (after a capture torch failed to end); skipped where this torch
    cannot (module docstring)."""
    if AVAILABLE:
        _end(device_index, pool)
