"""What the graph runners, the dispatcher and the engine above them declare to
each other: a runner reads a :class:`GraphHost`, which installs it (``use_graphs``)
in one of its two slots, :class:`StepGraphs` or :class:`TokenGraphs`, by its ``axis``."""

from __future__ import annotations

from typing import Optional, Protocol, Tuple, TypeVar, Union

import torch

from sgl_piecewise.backends.base import AttentionBackend
from sgl_piecewise.forward import ForwardBatch, ForwardMode
from sgl_piecewise.memory import ReqToTokenPool


class StepGraphs(Protocol):
    """Whole-model graphs along the batch axis, asked first for every step."""

    axis: str  # "batch": use_graphs installs it as step_graphs
    model_runner: "GraphHost"  # the host it was built for
    captured: bool  # capture() has run to the end
    max_bs: int  # the largest captured batch size

    def capture(self, progress: bool = True) -> float:
        """Capture every graph; the seconds it took."""

    @property
    def modes(self) -> Tuple[ForwardMode, ...]:
        """The forward modes it has graphs for."""

    def padded_bs(self, batch: ForwardBatch) -> Optional[int]:
        """The captured batch size ``batch`` replays at, or None."""

    def try_replay(self, batch: ForwardBatch) -> Optional[torch.Tensor]:
        """Hidden states ``[num_tokens, H]`` from a graph, or None to run eagerly."""


class TokenGraphs(Protocol):
    """Graphs along the token axis (piecewise or breakable), for any mode."""

    axis: str  # "tokens": use_graphs installs it as token_graphs
    model_runner: "GraphHost"  # the host it was built for
    captured: bool  # capture() has run to the end
    name: str  # the path counted in counters.step_paths
    max_size: int  # the largest token count it serves

    def capture(self, progress: bool = True) -> float:
        """Capture the graphs; the seconds it took."""

    def padded_size(self, num_tokens: int) -> Optional[int]:
        """The captured token count a step of ``num_tokens`` replays at, or None."""

    def replay(self, batch: ForwardBatch, padded: int) -> torch.Tensor:
        """Hidden states ``[num_tokens, H]`` through the graphs of ``padded`` tokens."""


Graphs = TypeVar("Graphs", bound=Union[StepGraphs, TokenGraphs])


class GraphHost(Protocol):
    """What a graph runner and the dispatcher read of a ``ModelRunner``, and its
    one route to install graphs (``use_graphs``)."""

    model: torch.nn.Module
    backend: AttentionBackend
    req_to_token_pool: ReqToTokenPool
    device: torch.device
    graphs: str  # the graph policy (dispatch.POLICIES)
    debug_checks: bool

    @property
    def step_graphs(self) -> Optional[StepGraphs]:
        """The whole-model graphs every step asks first, or None."""

    @property
    def token_graphs(self) -> Optional[TokenGraphs]:
        """The piecewise or breakable graphs, or None."""

    @property
    def max_context_len(self) -> int:
        """The most tokens one request holds."""

    def use_graphs(self, graphs: Graphs, *, progress: bool = True) -> Graphs:
        """Capture ``graphs`` unless captured, then serve later steps from them."""
