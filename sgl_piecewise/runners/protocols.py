"""What the graph runners, the dispatcher and the engine above them declare to
each other: a runner reads a :class:`GraphHost` and installs itself in one of
its two slots, :class:`StepGraphs` or :class:`TokenGraphs`."""

from __future__ import annotations

from typing import Optional, Protocol, Tuple

import torch

from sgl_piecewise.backends.base import AttentionBackend
from sgl_piecewise.forward import ForwardBatch, ForwardMode
from sgl_piecewise.memory import ReqToTokenPool


class StepGraphs(Protocol):
    """Whole-model graphs along the batch axis, asked first for every step."""

    max_bs: int  # the largest captured batch size

    @property
    def modes(self) -> Tuple[ForwardMode, ...]:
        """The forward modes it has graphs for."""

    def padded_bs(self, batch: ForwardBatch) -> Optional[int]:
        """The captured batch size ``batch`` replays at, or None."""

    def try_replay(self, batch: ForwardBatch) -> Optional[torch.Tensor]:
        """Hidden states ``[num_tokens, H]`` from a graph, or None to run eagerly."""


class TokenGraphs(Protocol):
    """Graphs along the token axis (piecewise or breakable), for any mode."""

    name: str  # the path counted in counters.step_paths
    max_size: int  # the largest token count it serves

    def padded_size(self, num_tokens: int) -> Optional[int]:
        """The captured token count a step of ``num_tokens`` replays at, or None."""

    def replay(self, batch: ForwardBatch, padded: int) -> torch.Tensor:
        """Hidden states ``[num_tokens, H]`` through the graphs of ``padded`` tokens."""


class GraphHost(Protocol):
    """What a graph runner reads of a ``ModelRunner``, and the slots it installs itself in."""

    model: torch.nn.Module
    backend: AttentionBackend
    req_to_token_pool: ReqToTokenPool
    device: torch.device
    graphs: str  # the graph policy (dispatch.POLICIES)
    debug_checks: bool
    step_graphs: Optional[StepGraphs]
    token_graphs: Optional[TokenGraphs]

    @property
    def max_context_len(self) -> int:
        """The most tokens one request holds."""
