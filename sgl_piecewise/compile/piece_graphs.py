"""Per-piece CUDA graphs, one per padded token count, driven by
``StepState.phase`` (RUN, WARMUP, CAPTURE, REPLAY); graph outputs are kept as
non-owning aliases into the pool. docs/ARCHITECTURE.md, "Per-piece graphs".
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from sgl_piecewise.errors import SglPiecewiseError
from sgl_piecewise.graphs.capture import GraphCapture
from sgl_piecewise.graphs.counters import counters
from sgl_piecewise.internals.storage_alias import non_owning_alias

_outputs_unused = contextvars.ContextVar("sgl_piecewise_outputs_unused", default=False)


@contextlib.contextmanager
def outputs_unused():
    """Steps run inside are captured for their graphs only, their outputs left
    unwritten: only for dummy inputs whose attention writes the dummy KV slot."""
    token = _outputs_unused.set(True)
    try:
        yield
    finally:
        _outputs_unused.reset(token)


class Phase(enum.Enum):
    RUN = "run"  # no graphs: run the compiled piece
    WARMUP = "warmup"
    CAPTURE = "capture"
    REPLAY = "replay"


@dataclass
class StepState:
    """Shared by every piece of one compiled graph; set per call by the top level."""

    phase: Phase = Phase.RUN
    num_tokens: int = 0  # real tokens of this call
    padded_tokens: int = 0  # the capture size they were padded to
    graph_set: int = 0  # one per set of static-input (weight) addresses
    replay_key: Tuple[int, int] = (0, 0)  # (graph_set, padded_tokens): the graphs this call replays
    use_cuda: bool = False
    debug_checks: bool = False
    capture: Optional[GraphCapture] = None  # pool and capture stream (CUDA only)


def _map_tensors(fn, value):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(fn, v) for v in value)
    return value


class StaticInputsMoved(SglPiecewiseError):
    """A piece's weight is not where its graph was captured; raised before any launch."""


def pointer_getter(indices: Sequence[int]) -> Callable[[Sequence[Any]], Tuple[int, ...]]:
    """``get(args)``: the data pointers of ``args[i]`` for ``i`` in ``indices``."""
    data_ptr = torch.Tensor.data_ptr
    if len(indices) == 1:
        (only,) = indices
        return lambda args: (args[only].data_ptr(),)
    pick = operator.itemgetter(*indices) if indices else (lambda args: ())
    return lambda args: tuple(map(data_ptr, pick(args)))


@dataclass
class _Entry:
    input_ptrs: List[Optional[int]]
    static_ptrs: Tuple[int, ...] = ()  # the static tensor inputs' addresses at capture
    graph: Optional[torch.cuda.CUDAGraph] = None
    outputs: Any = None  # non-owning aliases of the graph's outputs


@dataclass
class PieceGraphs:
    """Replaces one compiled piece inside the split module."""

    name: str
    compiled: Any
    state: StepState
    # Per argument: is its address fixed without a graph pool (weights, registry views)?
    static_args: Sequence[bool] = ()
    entries: Dict[Tuple[int, int], _Entry] = field(default_factory=dict)  # (graph_set, size) -> graph
    static_pointers: Callable[[Sequence[Any]], Tuple[int, ...]] = pointer_getter(())

    def __call__(self, *args):
        state = self.state
        if state.phase is Phase.REPLAY:
            if not state.debug_checks:  # the fast path of every step
                entry = self.entries.get(state.replay_key)
                if entry is not None and entry.graph is not None and self.static_pointers(args) == entry.static_ptrs:
                    counters.replays += 1
                    entry.graph.replay()
                    return entry.outputs
            out = self._replay(args)
        elif state.phase is Phase.CAPTURE:
            out = self._capture(args)
        else:  # RUN, WARMUP
            out = self.compiled(*args)
        if state.debug_checks and state.phase != Phase.RUN:
            _poison_padded_rows(out, state.num_tokens, state.padded_tokens)
        return out

    def _pointers(self, args: Sequence[Any]) -> List[Optional[int]]:
        checked = lambda i: self.state.use_cuda or (i < len(self.static_args) and self.static_args[i])  # noqa: E731
        return [a.data_ptr() if isinstance(a, torch.Tensor) and checked(i) else None for i, a in enumerate(args)]

    def _key(self) -> Tuple[int, int]:
        return self.state.replay_key

    def _capture(self, args: Tuple[Any, ...]) -> Any:
        if not self.entries:  # every call passes the same kinds of arguments
            static = [
                i
                for i, a in enumerate(args)
                if i < len(self.static_args) and self.static_args[i] and isinstance(a, torch.Tensor)
            ]
            self.static_pointers = pointer_getter(static)
        entry = _Entry(input_ptrs=self._pointers(args), static_ptrs=self.static_pointers(args))
        if self.state.use_cuda:
            out = self._capture_cuda_graph(entry, args)
        else:
            out = self.compiled(*args)
        self.entries[self._key()] = entry
        counters.graphs_captured += 1
        return out

    def _capture_cuda_graph(self, entry: _Entry, args: Tuple[Any, ...]) -> Any:
        graph, out = self.state.capture.record(
            lambda: self.compiled(*args), f"piecewise graph of {self.state.padded_tokens} tokens"
        )
        if not _outputs_unused.get():
            graph.replay()  # capture executed nothing; make this call's outputs real
        entry.graph = graph
        entry.outputs = _map_tensors(non_owning_alias, out)
        return out

    def _replay(self, args: Tuple[Any, ...]) -> Any:
        entry = self.entries.get(self._key())
        if entry is None:
            graph_set, size = self._key()
            raise SglPiecewiseError(
                f"{self.name}: expected a captured graph for {size} tokens (graph set {graph_set}), got none"
            )
        if self.static_pointers(args) != entry.static_ptrs:
            raise StaticInputsMoved(
                f"{self.name}: expected its static inputs (weights) at the addresses of graph set "
                f"{self._key()[0]}, got some at others"
            )
        if self.state.debug_checks:
            self._check_addresses(entry, args)
        counters.replays += 1
        if entry.graph is None:  # CPU pass-through
            return self.compiled(*args)
        entry.graph.replay()
        return entry.outputs

    def _check_addresses(self, entry: _Entry, args: Sequence[Any]) -> None:
        now = self._pointers(args)
        moved = [i for i, (a, b) in enumerate(zip(entry.input_ptrs, now)) if a is not None and a != b]
        if moved:
            raise SglPiecewiseError(
                f"{self.name}: graph inputs {moved} moved since capture at "
                f"{self.state.padded_tokens} tokens: expected the captured addresses, got new ones; "
                "a graph input must come from the registry, a weight or an earlier piece"
            )


def _poison_padded_rows(out: Any, num_tokens: int, padded: int) -> None:
    """NaN in the padded rows: any op that leaks them into real rows shows at once."""
    if padded <= num_tokens:
        return

    def poison(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.dim() and t.shape[0] == padded:
            t[num_tokens:].fill_(float("nan"))
        return t

    _map_tensors(poison, out)
