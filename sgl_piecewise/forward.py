"""The data of one forward step. Lengths, the same in every backend
(docs/ARCHITECTURE.md, "Length conventions"): ``extend_seq_lens`` counts
each request's new tokens, ``extend_prefix_lens`` its cached ones, and
``seq_lens`` is prefix + new, except in TARGET_VERIFY and DRAFT_EXTEND_V2,
where, as in SGLang, it is the prefix (``seq_lens_exclude_new_tokens``).
Token-major tensors may be padded past ``num_tokens`` for a graph.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.memory import check_request_lens
from sgl_piecewise.transfer import to_device


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5
    DRAFT_EXTEND = 6
    DRAFT_EXTEND_V2 = 7

    def is_extend(self) -> bool:
        return self in (
            ForwardMode.EXTEND,
            ForwardMode.MIXED,
            ForwardMode.TARGET_VERIFY,
            ForwardMode.DRAFT_EXTEND,
            ForwardMode.DRAFT_EXTEND_V2,
        )

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self, include_v2: bool = False) -> bool:
        if self == ForwardMode.DRAFT_EXTEND:
            return True
        return include_v2 and self == ForwardMode.DRAFT_EXTEND_V2

    def is_draft_extend_v2(self) -> bool:
        return self == ForwardMode.DRAFT_EXTEND_V2

    def is_cuda_graph(self) -> bool:
        """Modes a whole-model (batch-axis) graph can serve: a uniform number of new tokens, or none."""
        return self in (
            ForwardMode.DECODE,
            ForwardMode.TARGET_VERIFY,
            ForwardMode.IDLE,
            ForwardMode.DRAFT_EXTEND_V2,
        )

    def seq_lens_exclude_new_tokens(self) -> bool:
        """True where ``seq_lens`` holds the prefix only."""
        return self in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2)

    def has_uniform_query_width(self) -> bool:
        """Every request has the same number of new tokens."""
        return self in (
            ForwardMode.DECODE,
            ForwardMode.TARGET_VERIFY,
            ForwardMode.DRAFT_EXTEND_V2,
        )


@dataclass
class SpecInfo:
    """Speculative-decoding inputs of one step: ``num_tokens_per_req`` (the
    uniform query width), ``accept_lengths`` (accepted tokens per request) and
    ``custom_mask`` (TARGET_VERIFY's optional tree mask, row-major blocks)."""

    num_tokens_per_req: Optional[int] = None
    accept_lengths: Optional[torch.Tensor] = None
    custom_mask: Optional[torch.Tensor] = None


@dataclass
class ForwardBatch:
    """One step of a batch, token-major. See the module docstring for lengths."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [bs] int32
    seq_lens_cpu: Optional[torch.Tensor]  # [bs] int32, on the host (None: a graph's static batch that keeps none)
    extend_seq_lens: torch.Tensor  # [bs] int32, new tokens per request
    extend_prefix_lens: torch.Tensor  # [bs] int32, cached tokens before this step
    req_pool_indices: torch.Tensor  # [bs] int64, rows of req_to_token
    out_cache_loc: torch.Tensor  # [T] int64, KV slot of each new token
    extend_seq_lens_cpu: List[int] = field(default_factory=list)
    extend_prefix_lens_cpu: List[int] = field(default_factory=list)
    num_token_non_padded: Optional[torch.Tensor] = None  # scalar int32
    spec_info: Optional[SpecInfo] = None
    # Host copies of the index tensors, so the checks need not wait for the device.
    req_pool_indices_cpu: Optional[torch.Tensor] = None  # [bs] int64
    out_cache_loc_cpu: Optional[torch.Tensor] = None  # [T] int64

    @property
    def num_tokens(self) -> int:
        """Tokens that belong to requests (padding excluded)."""
        return int(sum(self.extend_seq_lens_cpu))

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def seq_lens_sum(self) -> int:
        # A Python sum of the host list: cheaper than a tensor sum and .item().
        return sum(self.seq_lens_cpu.tolist()) if self.batch_size else 0

    @classmethod
    def build(
        cls,
        forward_mode: ForwardMode,
        input_ids: torch.Tensor,
        req_pool_indices: torch.Tensor,
        prefix_lens: List[int],
        extend_lens: List[int],
        out_cache_loc: torch.Tensor,
        spec_info: Optional[SpecInfo] = None,
    ) -> "ForwardBatch":
        """Derive every length field and the positions from prefix and new counts.
        The index tensors may be on the host or the device; the batch holds them on
        ``input_ids``' device and keeps host copies for its checks."""
        prefix_lens, extend_lens = check_request_lens(prefix_lens, extend_lens)
        bs = len(prefix_lens)
        for name, t in (("req_pool_indices", req_pool_indices), ("out_cache_loc", out_cache_loc)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
                got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise InvalidInputError(f"{name}: expected a 1-D int64 tensor, got {got}")
        if req_pool_indices.shape != (bs,):
            raise InvalidInputError(
                f"expected {bs} requests in prefix_lens, extend_lens and req_pool_indices, "
                f"got {len(prefix_lens)}, {len(extend_lens)}, {tuple(req_pool_indices.shape)}"
            )
        num_tokens = sum(extend_lens)
        if input_ids.shape[0] < num_tokens or out_cache_loc.shape[0] < num_tokens:
            raise InvalidInputError(
                f"expected at least {num_tokens} tokens in input_ids and out_cache_loc, "
                f"got {input_ids.shape[0]} and {out_cache_loc.shape[0]}"
            )
        device = input_ids.device
        prefix_t = torch.tensor(prefix_lens, dtype=torch.int32)
        extend_t = torch.tensor(extend_lens, dtype=torch.int32)
        positions = torch.zeros(input_ids.shape[0], dtype=torch.int64)
        positions[:num_tokens] = token_positions(prefix_t, extend_t)
        seq_cpu = prefix_t if forward_mode.seq_lens_exclude_new_tokens() else prefix_t + extend_t
        count = torch.tensor(num_tokens, dtype=torch.int32)
        # One copy that does not wait (transfer.py): the host can build a step while one runs.
        moved = to_device((positions, seq_cpu, extend_t, prefix_t, req_pool_indices, out_cache_loc, count), device)
        return cls(
            forward_mode=forward_mode,
            batch_size=bs,
            input_ids=input_ids,
            positions=moved[0],
            seq_lens=moved[1],
            seq_lens_cpu=seq_cpu,
            extend_seq_lens=moved[2],
            extend_prefix_lens=moved[3],
            req_pool_indices=moved[4],
            out_cache_loc=moved[5],
            extend_seq_lens_cpu=list(extend_lens),
            extend_prefix_lens_cpu=list(prefix_lens),
            num_token_non_padded=moved[6],
            spec_info=spec_info,
            req_pool_indices_cpu=req_pool_indices.cpu(),
            out_cache_loc_cpu=out_cache_loc.cpu(),
        )


def token_positions(prefix_lens: torch.Tensor, extend_lens: torch.Tensor) -> torch.Tensor:
    """``[sum(extend_lens)]`` int64: each request's new tokens' positions, requests back to back."""
    extend = extend_lens.to(torch.int64)
    n = int(extend.sum())
    starts = torch.cumsum(extend, 0) - extend  # first token row of each request
    offset = prefix_lens.to(torch.int64) - starts  # position minus token row, per request
    return torch.arange(n, dtype=torch.int64, device=extend.device) + torch.repeat_interleave(
        offset, extend, output_size=n
    )
