"""The all-reduce after a row-parallel projection fused with the residual add
and RMSNorm that follow it: FlashInfer's ``trtllm_allreduce_fusion``
(pattern ``kARResidualRMSNorm``), one kernel in place of the all-reduce and
the add-and-norm kernel, twice per decoder layer; for rows wider than
:data:`FUSED_MAX_ROW_BYTES` the same kernel's all-reduce alone (pattern
``kAllReduce``, :func:`all_reduce`), which with our add-and-norm kernel
after it is measured faster there than the fused kernel.

Its all-reduce is a one-shot Lamport protocol: each rank stores its partial
sums into every peer's buffer over NVLink, and a reader knows a value has
arrived because it no longer holds the buffer's "empty" marker (negative
zero), so no barrier precedes the sum; three buffers take turns, each
cleared by the kernel that uses the next. The buffers are torch symmetric
memory (peer-mapped, no multicast), allocated and exchanged once per group
by :func:`allocate` (a collective, before any CUDA graph capture). Which
buffer comes next is kept on the device, so graph replays and eager calls
advance it alike, as long as every rank makes the same calls in the same
order, as tensor-parallel ranks do.

Arithmetic (``fp32_acc``): the ranks' partial sums add in float32 and round
once to the dtype, then the residual adds in float32 and rounds once: what
``residual + all_reduce(partial)`` gives at two ranks. The norm multiplies
``x * rsqrt(mean(x**2) + eps) * weight`` in float32 and rounds once, where
the formula (``models/norm.py``) rounds ``x * rsqrt(...)`` to the dtype
before the weight: the same in float32 up to the order the squares add in,
within a rounding in half precision.

What a workspace serves (:meth:`Workspace.serves`): ``[T, H]`` of its dtype (bf16,
fp16 or fp32) and hidden size on its device, ``T`` at most its token
count. ``prepare_communication`` sizes it for messages of at most
:data:`MAX_BYTES` and at most :data:`MAX_TOKENS` (the one-shot kernel's
limit). Larger steps take the unfused path.

Needs the ``flashinfer`` package (``AVAILABLE``); :func:`build` compiles
its kernels once per machine (minutes; then FlashInfer's cache serves), and
``prepare_communication`` calls it, outside any capture.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

import torch

from sgl_piecewise.distributed import registry

AVAILABLE: bool = importlib.util.find_spec("flashinfer") is not None
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_TOKENS = 128  # the one-shot kernel's limit (FlashInfer's kOneShotMaxToken)
# The largest message it is measured faster at (32 tokens of hidden size
# 4096 in bf16: bench_all_reduce.py --fused-norm, docs/BENCHMARKS.md).
MAX_BYTES = 256 * 1024
# Rows of at most this many bytes take the fused kernel; wider ones take its
# all-reduce alone, then the library's add + RMSNorm kernel. Measured a call
# at one token in bf16 (bench_all_reduce.py --fused-norm, docs/BENCHMARKS.md),
# fused against apart: hidden 896, 4.3 against 4.9 us; 2048, 4.8 against
# 4.6; 4096, 5.7 against 4.9 (and so at 8 and 32 tokens).
FUSED_MAX_ROW_BYTES = 2048
_VECTOR_BYTES = 16  # a row is read in 16-byte vectors

_comm: Any = None  # flashinfer.comm, imported by build()


def shape_ok(hidden_size: int, dtype: torch.dtype) -> bool:
    """Can the kernel take rows of ``hidden_size`` elements of ``dtype``?"""
    return dtype in DTYPES and hidden_size * dtype.itemsize % _VECTOR_BYTES == 0


@dataclass(eq=False)
class Workspace:
    """One group's buffers for the fused kernel, and what they serve."""

    rank: int
    size: int
    max_tokens: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    pointers: torch.Tensor  # every rank's buffer addresses, read by the kernel
    metadata: dict
    handles: list = field(repr=False)  # FlashInfer's, for release()

    def serves(self, x: torch.Tensor) -> bool:
        return (
            x.dim() == 2
            and x.shape[0] <= self.max_tokens
            and x.shape[1] == self.hidden_size
            and x.dtype == self.dtype
            and x.device == self.device
        )

    def release(self) -> None:
        _comm.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(self.handles)


def build() -> None:
    """Import FlashInfer's communication module and build its kernels (the
    first time on a machine, then cached), on this rank alone: raises what
    FlashInfer raises where it cannot."""
    global _comm
    if _comm is None:  # a heavy import, made only where it is used
        comm = importlib.import_module("flashinfer.comm")
        importlib.import_module("flashinfer.comm.trtllm_ar").get_trtllm_comm_module()
        _comm = comm


def allocate(rank: int, size: int, max_tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device, group_name: str) -> Workspace:  # fmt: skip
    """A workspace for ``[<= max_tokens, hidden_size]`` messages of ``dtype``,
    registered as the group's newest, after one call of each pattern (so
    that nothing runs for the first time inside a capture). Collective: every
    rank calls it with the same arguments, after :func:`build` succeeded on
    every rank."""
    group = registry.resolve_group(group_name)
    handles, pointers, metadata = _comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(
        rank, size, max_tokens, hidden_size, use_fp32_lamport=dtype == torch.float32, group=group,
        create_metadata=True,
    )  # fmt: skip
    x = torch.zeros(1, hidden_size, dtype=dtype, device=device)
    workspace = Workspace(rank, size, max_tokens, hidden_size, dtype, x.device, pointers, metadata, handles)
    add_rms_norm(workspace, x, x, torch.ones(hidden_size, dtype=dtype, device=device), 1e-6)
    all_reduce(workspace, x)
    torch.cuda.synchronize(device)
    registry.add_workspace(group_name, workspace)
    return workspace


def serving(group_name: str, x: torch.Tensor) -> Optional[Workspace]:
    """The group's newest workspace that serves ``x``, or None."""
    for workspace in reversed(registry.workspaces(group_name)):
        if workspace.serves(x):
            return workspace
    return None


def fuses_norm(hidden_size: int, dtype: torch.dtype) -> bool:
    """Do rows of ``hidden_size`` elements of ``dtype`` take the fused kernel
    (:func:`add_rms_norm`), or the all-reduce alone (:func:`all_reduce`) and
    a separate add + norm?"""
    return hidden_size * dtype.itemsize <= FUSED_MAX_ROW_BYTES


def all_reduce(workspace: Workspace, partial: torch.Tensor) -> torch.Tensor:
    """The ranks' sum of ``partial [T, H]`` (float32 sums, rounded once),
    through the same one-shot kernel and workspace, without the add and
    norm. ``partial`` must be served by the workspace."""
    out = torch.empty(partial.shape, dtype=partial.dtype, device=partial.device)
    _launch(
        workspace,
        partial,
        _comm.AllReduceFusionPattern.kAllReduce,
        allreduce_out=out,
        residual_in=None,
        residual_out=None,
        norm_out=None,
        rms_gamma=None,
        rms_eps=0.0,
    )
    return out


def add_rms_norm(workspace: Workspace, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> Tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(x, normed)``: ``x = residual + `` the ranks' sum of ``partial``
    ``[T, H]``, ``normed`` its RMSNorm by ``weight``, in one kernel.
    ``partial`` and ``residual`` must be served by the workspace."""
    x, normed = (torch.empty(partial.shape, dtype=residual.dtype, device=residual.device) for _ in range(2))
    _launch(
        workspace,
        partial,
        _comm.AllReduceFusionPattern.kARResidualRMSNorm,
        allreduce_out=None,
        residual_in=residual.contiguous(),
        residual_out=x,
        norm_out=normed,
        rms_gamma=weight,
        rms_eps=eps,
    )
    return x, normed


def _launch(workspace: Workspace, partial: torch.Tensor, pattern: Any, **outputs: Any) -> None:
    """``trtllm_allreduce_fusion`` over the workspace with ``pattern``: the
    one-shot kernel, float32 sums, no quantisation; ``outputs`` name the
    pattern's operands."""
    tokens, hidden = partial.shape
    _comm.trtllm_allreduce_fusion(
        allreduce_in=partial.contiguous(), world_size=workspace.size, world_rank=workspace.rank, token_num=tokens,
        hidden_dim=hidden, workspace_ptrs=workspace.pointers, launch_with_pdl=False, trigger_completion_at_end=True,
        fp32_acc=True, pattern_code=pattern, use_oneshot=True, quant_out=None, scale_out=None, scale_factor=None,
        layout_code=None, metadata=workspace.metadata, **outputs,
    )  # fmt: skip
