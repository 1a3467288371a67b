"""The metadata fill of one bound batch size, recorded once as a CUDA graph.

A backend's ``_fill_metadata`` is some 25 small device operations (lengths,
indptrs, the flattened page table, split counts). Launched from Python they
cost about half a millisecond of host time per step, as much as a whole 0.5B
decode graph's kernels. When the fill writes into static buffers (a graph
binding, ``StaticGraphBackend``) its addresses never move, so it can be
recorded once and replayed: per step that leaves copies of the inputs
(``req_pool_indices``, ``seq_lens``, and a ragged step's ``extend_lens``)
into the graph's own input buffers and one graph launch.

Recorded only where that is exact (``backends/static_graph.py:
can_record_fill``); elsewhere the fill runs as plain operations. The
backends sit below this layer: ``record_fills`` hands them the recorder
when a graph path reserves its bindings. The
recording goes into the shared capture pool (``graphs/capture.py``): its
intermediates are rewritten on each replay, and its outputs are the
backend's static buffers, which live outside the pool.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from sgl_piecewise.backends.base import AttentionBackend
from sgl_piecewise.graphs.capture import shared_capture

# The fill, given the step's input tensors (or the graph's copies of them).
Fill = Callable[..., None]


class FillGraph:
    """The recorded fill of one binding, with the input buffers it reads.

    The first :meth:`run` fills with plain operations (that is also the
    warm-up the recording needs) and records the fill; every later run copies
    the inputs in and replays.
    """

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
        # A binding has one batch size, so the shapes match; a caller passing
        # other dtypes gets the plain fill rather than a silent cast.
        return len(inputs) == len(self.inputs) and all(a.dtype == b.dtype for a, b in zip(inputs, self.inputs))

    def _record(self, fill: Fill, inputs: Tuple[torch.Tensor, ...]) -> None:
        self.inputs = tuple(t.clone() for t in inputs)
        core = shared_capture(inputs[0].device)
        self.graph, _ = core.record(lambda: fill(*self.inputs), self.what)


def record_fills(backend: AttentionBackend) -> None:
    """Let ``backend`` record its bound fills through the shared capture core
    (the backends sit below this layer, so it hands them the recorder)."""
    backend.use_fill_recorder(FillGraph)


def reserve_eager_bindings(backend: AttentionBackend, max_reqs: int, max_tokens: int) -> None:
    """The attention between graphs runs eagerly on every step a graph of at
    most ``max_tokens`` tokens serves: let the backend fill those steps'
    metadata into static buffers (recorded fills) rather than fresh tensors,
    for as many requests as such a step can hold."""
    record_fills(backend)
    backend.reserve_eager_bindings(min(max_reqs, max_tokens), max_tokens)
