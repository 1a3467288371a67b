"""The process groups, symmetric-memory buffers and fused-norm workspaces
the communication ops find by a group's name, and the CUDA graphs captured
while a group was current.

The ops take the name, a string, rather than the group: a custom op's
arguments are tensors and plain values, and a string is what Dynamo puts
in a graph as a constant. ``torch.distributed`` keeps its own name-to-group
table, but only privately; this one holds the groups
:func:`~sgl_piecewise.distributed.init_tensor_parallel` made.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from sgl_piecewise.errors import InvalidInputError

_groups: Dict[str, "dist.ProcessGroup"] = {}
# Per group, every buffer allocated, the newest last: the ops use the newest;
# the older ones stay allocated, because a graph captured with one replays it.
_buffers: Dict[str, List[torch.Tensor]] = {}
# Per group, the same for the fused all-reduce + norm's workspaces (fused_norm.py).
_workspaces: Dict[str, List[Any]] = {}
# Per group, the CUDA graphs captured while it was current, held weakly. NCCL
# does not destroy a communicator while a graph holding its kernels exists:
# destroy_process_group() waits for that forever (pytorch/pytorch#115388), and
# a compiled function's cache keeps its graphs alive as long as the process.
_graphs: Dict[str, "weakref.WeakSet[torch.cuda.CUDAGraph]"] = {}


def register_group(group: "dist.ProcessGroup") -> str:
    """Make ``group`` findable by its name; return the name."""
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
    """Drop the group, its buffers, workspaces and graphs (when the group is destroyed)."""
    _groups.pop(name, None)
    _buffers.pop(name, None)
    for workspace in _workspaces.pop(name, ()):
        workspace.release()
    _graphs.pop(name, None)


def add_graph(name: str, graph: "torch.cuda.CUDAGraph") -> None:
    """Remember ``graph`` (weakly) as one that may hold the group's collectives."""
    _graphs.setdefault(name, weakref.WeakSet()).add(graph)


def reset_graphs(name: str) -> int:
    """Reset (free) every live graph captured while the group was current, so
    that its communicators can be destroyed; return how many. A reset graph
    refuses a later replay with torch's error."""
    graphs = list(_graphs.pop(name, ()))
    for graph in graphs:
        graph.reset()
    return len(graphs)


def add_buffer(name: str, buffer: torch.Tensor) -> None:
    _buffers.setdefault(name, []).append(buffer)


def symmetric_buffer(name: str) -> Optional[torch.Tensor]:
    """The group's newest symmetric-memory buffer, or None."""
    buffers = _buffers.get(name)
    return buffers[-1] if buffers else None


def symmetric_buffer_bytes(name: str) -> int:
    """The size of the buffer the group's small all-reduces use; 0 when none
    was allocated (they then go through NCCL)."""
    buffer = symmetric_buffer(name)
    return 0 if buffer is None else buffer.numel() * buffer.element_size()


def add_workspace(name: str, workspace: Any) -> None:
    _workspaces.setdefault(name, []).append(workspace)


def workspaces(name: str) -> List[Any]:
    """The group's fused-norm workspaces, the newest last."""
    return list(_workspaces.get(name, ()))
