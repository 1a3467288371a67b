"""Capture in lockstep across a tensor-parallel group: a collective captured
on one rank pairs with the same graph's on another, so every rank captures
the same sizes in the same order, each after all ranks finished the work before.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sgl_piecewise.distributed import TensorParallel
from sgl_piecewise.errors import InvalidInputError


def check_same_sizes(tp: TensorParallel, sizes: Sequence[int], what: str) -> None:
    """Refuse, on every rank alike, sizes that differ between ranks (the collectives would hang)."""
    if tp.size == 1:
        return
    every = tp.all_gather_object(list(sizes))
    if any(s != every[0] for s in every):
        per_rank = "; ".join(f"rank {r}: {s}" for r, s in enumerate(every))
        raise InvalidInputError(
            f"{what}: expected the same sizes on every rank of the tensor-parallel group, got {per_rank}; "
            "give every rank the same capture sizes and the same limits (max_reqs, max_context_len)"
        )


def meet(tp: TensorParallel, device: torch.device) -> None:
    """Wait until every rank has finished its work so far."""
    if tp.size == 1:
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tp.barrier()
