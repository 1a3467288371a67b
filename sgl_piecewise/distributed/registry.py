"""The process groups, symmetric-memory buffers, fused-norm workspaces and
CUDA graphs the communication ops find by a group's name: a string is what
Dynamo puts in a graph as a constant (``torch.distributed``'s own table is
private).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from sgl_piecewise.errors import InvalidInputError

_groups: Dict[str, "dist.ProcessGroup"] = {}
# Per group, every buffer, newest last: the ops use the newest, graphs the older.
_buffers: Dict[str, List[torch.Tensor]] = {}
_workspaces: Dict[str, List[Any]] = {}
# Per group, the graphs captured while it was current (weakly): NCCL will not
# destroy a communicator while a graph holding its kernels lives.
_graphs: Dict[str, "weakref.WeakSet[torch.cuda.CUDAGraph]"] = {}


def register_group(group: "dist.ProcessGroup") -> str:
    name = group.group_name
    _groups[name] = group
    return name


def resolve_group(name: str) -> "dist.ProcessGroup":
    group = _groups.get(name)
    if group is None:
        known = sorted(_groups) or "none"
        raise InvalidInputError(
            f"group_name: expected the name of a process group made by init_tensor_parallel (known: {known}), "
            f"got {name!r}"
        )
    return group


def forget_group(name: str) -> None:
    _groups.pop(name, None)
    _buffers.pop(name, None)
    for workspace in _workspaces.pop(name, ()):
        workspace.release()
    _graphs.pop(name, None)


def add_graph(name: str, graph: "torch.cuda.CUDAGraph") -> None:
    _graphs.setdefault(name, weakref.WeakSet()).add(graph)


def reset_graphs(name: str) -> int:
    """Reset every live graph captured while the group was current; return how many."""
    graphs = list(_graphs.pop(name, ()))
    for graph in graphs:
        graph.reset()
    return len(graphs)


def add_buffer(name: str, buffer: torch.Tensor) -> None:
    _buffers.setdefault(name, []).append(buffer)


def symmetric_buffer(name: str) -> Optional[torch.Tensor]:
    buffers = _buffers.get(name)
    return buffers[-1] if buffers else None


def symmetric_buffer_bytes(name: str) -> int:
    buffer = symmetric_buffer(name)
    return 0 if buffer is None else buffer.numel() * buffer.element_size()


def add_workspace(name: str, workspace: Any) -> None:
    _workspaces.setdefault(name, []).append(workspace)


def workspaces(name: str) -> List[Any]:
    return list(_workspaces.get(name, ()))
