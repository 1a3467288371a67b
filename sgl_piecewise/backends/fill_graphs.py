"""The metadata fill of one bound batch size, recorded once as a CUDA graph.

A backend's ``_fill_metadata`` is some 25 small device operations (lengths,
indptrs, the flattened page table, split counts). Launched from Python they
cost about half a millisecond of host time per step, as much as a whole 0.5B
decode graph's kernels. When the fill writes into static buffers (a graph
binding, ``StaticGraphBackend``) its addresses never move, so it can be
recorded once and replayed: per step that leaves copies of the inputs
(``req_pool_indices``, ``seq_lens``, and a ragged step's ``extend_lens``)
into the graph's own input buffers and one graph launch.

Recorded only where that is exact: on CUDA, for fills that read nothing from
the host but their input tensors (no tree mask: its flat length changes each
step), and outside another capture (there the fill is recorded into the
outer graph, as before). Elsewhere the fill runs as plain operations. The
recording goes into the shared capture pool (``runners/capture.py``): its
intermediates are rewritten on each replay, and its outputs are the
backend's static buffers, which live outside the pool.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

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
        from sgl_piecewise.runners.capture import shared_capture  # runners/ builds on backends/

        self.inputs = tuple(t.clone() for t in inputs)
        core = shared_capture(inputs[0].device)
        self.graph, _ = core.record(lambda: fill(*self.inputs), self.what)


def can_record_fill(device: torch.device, masked: bool) -> bool:
    """Whether a bound fill on ``device`` may be recorded now (module docstring)."""
    return device.type == "cuda" and not masked and not torch.cuda.is_current_stream_capturing()
