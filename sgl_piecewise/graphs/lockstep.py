"""Capture in lockstep across the ranks of a tensor-parallel group.

Every rank's graphs hold the same collectives in the same order, and a
collective captured on one rank pairs with the one the same graph replays on
another: so every rank captures the same sizes in the same order, and each
capture starts only when every rank has finished the work before it (a
synchronize, then a barrier on the group's CPU side), as SGLang's runners
do. At one rank both are free: nothing is exchanged.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sgl_piecewise.distributed import TensorParallel
from sgl_piecewise.errors import InvalidInputError


def check_same_sizes(tp: TensorParallel, sizes: Sequence[int], what: str) -> None:
    """Refuse, on every rank alike, a capture whose sizes differ between
    ranks: the ranks would pair collectives of different graphs and hang."""
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
