"""FlashInfer's ``trtllm_allreduce_fusion``: the all-reduce after a
row-parallel projection fused with the residual add and RMSNorm after it,
one kernel (a one-shot Lamport all-reduce over peer-mapped symmetric memory,
no multicast, no barrier); rows wider than :data:`FUSED_MAX_ROW_BYTES` take
its all-reduce alone. Sums in float32, rounded once. Needs ``flashinfer``;
:func:`build` compiles its kernels once per machine, :func:`allocate` is
collective and runs before any capture.
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
# Sizes where the fused kernel is faster (docs/BENCHMARKS.md).
MAX_BYTES = 256 * 1024
FUSED_MAX_ROW_BYTES = 2048
_VECTOR_BYTES = 16  # a row is read in 16-byte vectors

_comm: Any = None  # flashinfer.comm, imported by build()


def shape_ok(hidden_size: int, dtype: torch.dtype) -> bool:
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
    """Import FlashInfer's comm module and build its kernels on this rank (raises where it cannot)."""
    global _comm
    if _comm is None:  # a heavy import, made only where it is used
        comm = importlib.import_module("flashinfer.comm")
        importlib.import_module("flashinfer.comm.trtllm_ar").get_trtllm_comm_module()
        _comm = comm


def allocate(
    rank: int, size: int, max_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device, group_name: str
) -> Workspace:
    """A workspace for ``[<= max_tokens, hidden_size]`` of ``dtype``, each pattern
    run once (nothing runs first inside a capture). Collective, after
    :func:`build`."""
    group = registry.resolve_group(group_name)
    handles, pointers, metadata = _comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(
        rank,
        size,
        max_tokens,
        hidden_size,
        use_fp32_lamport=dtype == torch.float32,
        group=group,
        create_metadata=True,
    )
    x = torch.zeros(1, hidden_size, dtype=dtype, device=device)
    workspace = Workspace(rank, size, max_tokens, hidden_size, dtype, x.device, pointers, metadata, handles)
    add_rms_norm(workspace, x, x, torch.ones(hidden_size, dtype=dtype, device=device), 1e-6)
    all_reduce(workspace, x)
    torch.cuda.synchronize(device)
    registry.add_workspace(group_name, workspace)
    return workspace


def serving(group_name: str, x: torch.Tensor) -> Optional[Workspace]:
    for workspace in reversed(registry.workspaces(group_name)):
        if workspace.serves(x):
            return workspace
    return None


def fuses_norm(hidden_size: int, dtype: torch.dtype) -> bool:
    """Do such rows take the fused kernel, or the all-reduce alone and a separate norm?"""
    return hidden_size * dtype.itemsize <= FUSED_MAX_ROW_BYTES


def all_reduce(workspace: Workspace, partial: torch.Tensor) -> torch.Tensor:
    """The ranks' sum of ``partial [T, H]`` through the same kernel, without the norm."""
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


def add_rms_norm(
    workspace: Workspace, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(x, normed)``: ``residual`` plus the ranks' sum of ``partial``, and its RMSNorm."""
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
    tokens, hidden = partial.shape
    _comm.trtllm_allreduce_fusion(
        allreduce_in=partial.contiguous(),
        world_size=workspace.size,
        world_rank=workspace.rank,
        token_num=tokens,
        hidden_dim=hidden,
        workspace_ptrs=workspace.pointers,
        launch_with_pdl=False,
        trigger_completion_at_end=True,
        fp32_acc=True,
        pattern_code=pattern,
        use_oneshot=True,
        quant_out=None,
        scale_out=None,
        scale_factor=None,
        layout_code=None,
        metadata=workspace.metadata,
        **outputs,
    )
