"""A bound batch size's metadata fill (many small device ops), recorded
once as a CUDA graph: it writes into static buffers, so a step copies its
inputs in and launches one graph. Recorded only where exact
(``StaticGraphBackend.can_record_fill``); the backends sit below this layer,
so ``record_fills`` hands them the recorder.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from sgl_piecewise.backends.base import AttentionBackend
from sgl_piecewise.graphs.capture import shared_capture

Fill = Callable[..., None]


class FillGraph:
    """The recorded fill of one binding. The first :meth:`run` fills eagerly
    (the warm-up) and records; later runs copy the inputs in and replay."""

    def __init__(self, what: str):
        self.what = what
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.inputs: Tuple[torch.Tensor, ...] = ()  # the graph's copies of the inputs

    def run(self, fill: Fill, inputs: Tuple[torch.Tensor, ...]) -> None:
        if self.graph is not None and self._inputs_fit(inputs):
            for mine, given in zip(self.inputs, inputs):
                mine.copy_(given)
            self.graph.replay()
            return
        fill(*inputs)
        if self.graph is None:
            self._record(fill, inputs)

    def _inputs_fit(self, inputs: Tuple[torch.Tensor, ...]) -> bool:
        # Shapes match (one batch size per binding); other dtypes get the plain fill, not a cast.
        return len(inputs) == len(self.inputs) and all(a.dtype == b.dtype for a, b in zip(inputs, self.inputs))

    def _record(self, fill: Fill, inputs: Tuple[torch.Tensor, ...]) -> None:
        self.inputs = tuple(t.clone() for t in inputs)
        core = shared_capture(inputs[0].device)
        self.graph, _ = core.record(lambda: fill(*self.inputs), self.what)


def record_fills(backend: AttentionBackend) -> None:
    """Let ``backend`` record its bound fills through the shared capture core."""
    backend.use_fill_recorder(FillGraph)


def reserve_eager_bindings(backend: AttentionBackend, max_reqs: int, max_tokens: int) -> None:
    """Let the eager attention between graphs of at most ``max_tokens`` tokens
    fill its metadata into static buffers (recorded fills)."""
    record_fills(backend)
    backend.reserve_eager_bindings(min(max_reqs, max_tokens), max_tokens)
