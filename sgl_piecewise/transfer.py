"""Small host tensors to the device in one copy that does not wait.

A step's index and length tensors are a few hundred bytes each. Copied one by
one from pageable memory, each copy blocks the host until the device has
finished all earlier work, so the host cannot prepare a step while the one
before it runs. Here they are packed into one pinned buffer (torch's caching
host allocator keeps it until its copy has run) and sent with one
non-blocking copy; each result is a view of that one device buffer.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

ALIGN = 16  # bytes: every packed tensor starts where a vectorised load may begin


def to_device(tensors: Sequence[torch.Tensor], device: torch.device | str) -> List[torch.Tensor]:
    """``tensors`` on ``device``, same shapes and dtypes. For a CUDA device the
    host tensors among them go in one non-blocking copy; the rest, and every
    tensor for another kind of device, move as ``Tensor.to`` moves them."""
    device = torch.device(device)
    host = [i for i, t in enumerate(tensors) if t.device.type == "cpu"]
    if device.type != "cuda" or not host:
        return [t.to(device) for t in tensors]
    staging, offsets = pack([tensors[i] for i in host], pin_memory=True)
    views = unpack(staging.to(device, non_blocking=True), [tensors[i] for i in host], offsets)
    out = [t if t.device.type == "cpu" else t.to(device) for t in tensors]
    for i, view in zip(host, views):
        out[i] = view
    return out


def pack(tensors: Sequence[torch.Tensor], *, pin_memory: bool = False) -> Tuple[torch.Tensor, List[int]]:
    """One uint8 host buffer holding ``tensors`` back to back, each at a
    multiple of ``ALIGN`` bytes; and each one's byte offset."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-_nbytes(t) // ALIGN) * ALIGN
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=pin_memory)
    for t, start in zip(tensors, offsets):
        staging[start : start + _nbytes(t)].view(t.dtype).copy_(t.reshape(-1))
    return staging, offsets


def unpack(packed: torch.Tensor, like: Sequence[torch.Tensor], offsets: Sequence[int]) -> List[torch.Tensor]:
    """Views of ``packed`` (``pack``'s buffer, wherever it now is) shaped and typed as ``like``."""
    return [packed[start : start + _nbytes(t)].view(t.dtype).view(t.shape) for t, start in zip(like, offsets)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
