"""Length arithmetic every graph-capable backend's eager, capture and replay
paths share, so they cannot drift apart (the reference backend, the oracle,
computes its own)."""

from __future__ import annotations

from typing import Optional

import torch

from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.forward import ForwardMode


def kv_lens(mode: ForwardMode, seq_lens: torch.Tensor, extend_seq_lens: torch.Tensor) -> torch.Tensor:
    """Key extent per request: ``prefix + new`` for TARGET_VERIFY and
    DRAFT_EXTEND_V2 (whose ``seq_lens`` hold the prefix), else ``seq_lens``."""
    if mode.seq_lens_exclude_new_tokens():
        return seq_lens + extend_seq_lens
    return seq_lens


def query_width(mode: ForwardMode, num_tokens_per_req: Optional[int]) -> int:
    """Uniform query width of a uniform mode (1 for DECODE)."""
    if mode.is_decode():
        return 1
    if num_tokens_per_req is None:
        raise InvalidInputError(f"{mode.name}: expected spec_info.num_tokens_per_req, got None")
    return int(num_tokens_per_req)


def cumsum_with_zero(lens: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[0, l0, l0+l1, ...]`` as int32; written into ``out[: len+1]`` if given."""
    n = lens.shape[0]
    if out is None:
        out = torch.empty(n + 1, dtype=torch.int32, device=lens.device)
    out[:1].zero_()  # not `out[0] = 0`: that copies a host scalar and syncs
    torch.cumsum(lens, dim=0, out=out[1 : n + 1])
    return out[: n + 1]


def max_kv_len(kv: torch.Tensor) -> int:
    """``max_i(prefix_i + extend_i)`` per request, not ``max(prefix)+max(extend)``."""
    return int(kv.max().item()) if kv.numel() else 0
