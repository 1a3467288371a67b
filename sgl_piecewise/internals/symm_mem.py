"""Small all-reduces through torch's symmetric memory (the private
``torch.distributed._symmetric_memory`` and the ``symm_mem`` one-shot and
two-shot ops, never multicast; torch 2.11-2.13), for the tensor-parallel
``all_reduce``. Why: one kernel reading the peers' buffers beats NCCL on a
decode step's small messages. Fallback: ``torch.distributed.all_reduce``.
"""

from __future__ import annotations

import importlib

import torch

TORCH_VERSIONS = ("2.11", "2.13")  # written against; others are only checked for what is used

DTYPES = (torch.bfloat16, torch.float32)  # what the ops dispatch
_ALIGNMENT = 4  # the message's bytes a multiple of this


class SymmMemUnavailable(Exception):
    """:data:`AVAILABLE` is False."""


def _find() -> tuple:
    try:
        module = importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as e:
        return None, None, f"torch {torch.__version__} has no torch.distributed._symmetric_memory ({e})"
    for name in ("empty", "rendezvous"):
        if not callable(getattr(module, name, None)):
            return None, None, f"torch {torch.__version__} has no torch.distributed._symmetric_memory.{name}"
    op = getattr(getattr(torch.ops, "symm_mem", None), "one_shot_all_reduce", None)
    if op is None:
        return None, None, f"torch {torch.__version__} has no torch.ops.symm_mem.one_shot_all_reduce"
    if not torch.backends.cuda.is_built():
        return None, None, f"torch {torch.__version__} is built without CUDA"
    return module, op, ""


_module, _one_shot, UNAVAILABLE_REASON = _find()
AVAILABLE: bool = not UNAVAILABLE_REASON
_one_shot_copy = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy", None) if AVAILABLE else None
# Where set (read at every call): the one-shot op copies the input in its own kernel.
COPY_IN_KERNEL: bool = _one_shot_copy is not None
_two_shot = getattr(torch.ops.symm_mem, "two_shot_all_reduce_out", None) if AVAILABLE else None
TWO_SHOT: bool = _two_shot is not None


def _require() -> None:
    if not AVAILABLE:
        raise SymmMemUnavailable(UNAVAILABLE_REASON)


def allocate(nbytes: int, device: torch.device, group_name: str) -> torch.Tensor:
    """A buffer in symmetric memory (collective; before any capture using it)."""
    _require()
    buffer = _module.empty(nbytes, dtype=torch.uint8, device=device)
    _module.rendezvous(buffer, group_name)
    return buffer


def fits(x: torch.Tensor, buffer: torch.Tensor) -> bool:
    nbytes = x.numel() * x.element_size()
    return (
        x.dtype in DTYPES
        and nbytes % _ALIGNMENT == 0
        and nbytes <= buffer.numel() * buffer.element_size()
        and x.device == buffer.device
    )


def one_shot_all_reduce(x: torch.Tensor, buffer: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the group, as a new tensor (``x`` must :func:`fits`)."""
    _require()
    prefix = _prefix(x, buffer)
    if COPY_IN_KERNEL and _one_shot_copy is not None:
        return _one_shot_copy(prefix, x.contiguous(), "sum", group_name)
    prefix.copy_(x)
    return _one_shot(prefix, "sum", group_name)


def two_shot_all_reduce(x: torch.Tensor, buffer: torch.Tensor, group_name: str) -> torch.Tensor:
    _require()
    if not TWO_SHOT or _two_shot is None:
        raise SymmMemUnavailable(f"torch {torch.__version__} has no torch.ops.symm_mem.two_shot_all_reduce_out")
    prefix = _prefix(x, buffer)
    prefix.copy_(x)
    return _two_shot(prefix, "sum", group_name, torch.empty(x.shape, dtype=x.dtype, device=x.device))


def _prefix(x: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    return buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
