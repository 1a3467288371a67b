"""Small all-reduces through torch's symmetric memory, for the tensor-parallel
``all_reduce`` op (``distributed/comm_ops.py``).

What it uses: the private module ``torch.distributed._symmetric_memory``:
``empty`` allocates a buffer that every rank of a group can map, and
``rendezvous`` exchanges its handles over the group's store (a collective,
once per buffer). The op ``torch.ops.symm_mem.one_shot_all_reduce`` then
has every rank read every peer's buffer with plain loads over NVLink and
sum them, in one kernel that synchronises the ranks through the buffer's
signal pads: no NCCL launch, no proxy thread. It takes a view of the
buffer's prefix (it finds the buffer from the view's storage and adds the
view's offset), so one buffer sized for the largest message serves every
smaller one: the input is copied into the prefix, and the result is a new
tensor. Where torch has ``one_shot_all_reduce_copy`` (2.11 does), the
kernel copies the input into the prefix itself (:data:`COPY_IN_KERNEL`):
one kernel per all-reduce instead of a copy and the op, 64 fewer kernels in
a decode step of a 32-layer model.

Larger messages take torch's two-shot op, ``two_shot_all_reduce_out``,
where torch has it (:data:`TWO_SHOT`): each rank sums one share of the
message from every peer's buffer, then the ranks exchange the summed
shares (peer loads and stores, signal pads): less traffic a rank than
one-shot's read of every peer's whole message, for a second barrier (the
caller picks the op by size, ``comm_ops.py``).

Why: the figure it pays on is a bf16 all-reduce of 896 elements (one
decode token of a 0.5B model's hidden size) inside a CUDA graph on 2x
H200: 6.0 µs one-shot through symmetric memory against 17.5 µs through
NCCL, twice per layer per step.

No multicast: only the one-shot and two-shot ops are used (peer loads,
stores and signal pads), never an op built on multicast objects (NVLS).
The package sets ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NCCL_NVLS_ENABLE=0`` and
``NVSHMEM_DISABLE_NVLS=1`` before any group starts, overriding a value
that would allow multicast (``distributed/groups.py``).

What the ops accept (checked by :func:`fits`, so a call never reaches an
op's own refusal): bfloat16 or float32 (the ops dispatch only these), a
size in bytes that is a multiple of 4 (their alignment check), at most the
buffer's size, on the buffer's device.

Written against torch 2.11-2.13. :data:`AVAILABLE` says at import whether
the module, its two functions and the op are there and torch is built with
CUDA (a CPU build has the module and the op's meta kernel, nothing to run
it on). It is read at every call, so a test sets it False to force the
fallback. Fallback: the caller takes NCCL's ``torch.distributed.all_reduce``
(gloo on the CPU), the same sums at NCCL's latency.
"""

from __future__ import annotations

import importlib

import torch

TORCH_VERSIONS = ("2.11", "2.13")  # written against; others are only checked for what is used

# The dtypes one_shot_all_reduce dispatches (bf16 and fp32 only: no fp16).
DTYPES = (torch.bfloat16, torch.float32)
# Its alignment check: the message's bytes a multiple of max(4, itemsize).
_ALIGNMENT = 4


class SymmMemUnavailable(Exception):
    """This torch cannot allocate or reduce through symmetric memory
    (:data:`AVAILABLE` False)."""


def _find() -> tuple:
    """(the private module, the op, why not) on this torch."""
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
# The op that copies the input into the buffer in its own kernel, where this
# torch has it. Read at every call: a test sets it False to run the copy and
# the plain op instead, the same sums.
COPY_IN_KERNEL: bool = _one_shot_copy is not None
_two_shot = getattr(torch.ops.symm_mem, "two_shot_all_reduce_out", None) if AVAILABLE else None
# Whether this torch has the two-shot op. Read at every call: a test sets
# it False to send every message the one-shot op.
TWO_SHOT: bool = _two_shot is not None


def _require() -> None:
    if not AVAILABLE:
        raise SymmMemUnavailable(UNAVAILABLE_REASON)


def allocate(nbytes: int, device: torch.device, group_name: str) -> torch.Tensor:
    """A ``uint8`` buffer of ``nbytes`` in symmetric memory on ``device``,
    its handles exchanged with every rank of the group. Collective: every
    rank calls it, with the same size, before any CUDA graph captures a use
    of it (a capture cannot allocate one)."""
    _require()
    buffer = _module.empty(nbytes, dtype=torch.uint8, device=device)
    _module.rendezvous(buffer, group_name)
    return buffer


def fits(x: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Can the one-shot and two-shot ops reduce ``x`` through ``buffer`` (module docstring)?"""
    nbytes = x.numel() * x.element_size()
    return (
        x.dtype in DTYPES
        and nbytes % _ALIGNMENT == 0
        and nbytes <= buffer.numel() * buffer.element_size()
        and x.device == buffer.device
    )


def one_shot_all_reduce(x: torch.Tensor, buffer: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the group's ranks, as a new contiguous tensor of
    ``x``'s shape: ``x`` copied into the buffer's prefix, then the one-shot
    op on that prefix. ``x`` must :func:`fits` the buffer; every rank calls
    it with the same shape."""
    _require()
    prefix = _prefix(x, buffer)
    if COPY_IN_KERNEL and _one_shot_copy is not None:
        return _one_shot_copy(prefix, x.contiguous(), "sum", group_name)
    prefix.copy_(x)
    return _one_shot(prefix, "sum", group_name)


def two_shot_all_reduce(x: torch.Tensor, buffer: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the group's ranks through the two-shot op
    (module docstring), as a new contiguous tensor of ``x``'s shape; the
    same contract as :func:`one_shot_all_reduce`. The op also leaves the
    sum in the buffer's prefix, which nothing reads."""
    _require()
    if not TWO_SHOT or _two_shot is None:
        raise SymmMemUnavailable(f"torch {torch.__version__} has no torch.ops.symm_mem.two_shot_all_reduce_out")
    prefix = _prefix(x, buffer)
    prefix.copy_(x)
    return _two_shot(prefix, "sum", group_name, torch.empty(x.shape, dtype=x.dtype, device=x.device))


def _prefix(x: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """The buffer's first bytes, as a contiguous tensor of ``x``'s shape and dtype."""
    return buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
