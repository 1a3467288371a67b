"""The metadata fill of one bound batch size, recorded once as a CUDA graph.

A backend's ``_fill_metadata`` is some 25 small device operations (lengths,
indptrs, the flattened page table, split counts). Launched from Python they
cost about half a millisecond of host time per step, as much as a whole 0.5B
decode graph's kernels. When the fill writes into static buffers (a graph
binding, ``StaticGraphBackend``) its addresses never move, so it can be
recorded once and replayed: per step that leaves two copies of the inputs
(``req_pool_indices``, ``seq_lens``) into the graph's own input buffers and
one graph launch.

Recorded only where that is exact: on CUDA, for fills that read nothing from
the host but their two input tensors (no tree mask: its flat length changes
each step), and outside another capture (there the fill is recorded into the
outer graph, as before). Elsewhere the fill runs as plain operations. The
recording goes into the shared capture pool (``runners/capture.py``): its
intermediates are rewritten on each replay, and its outputs are the
backend's static buffers, which live outside the pool.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

# The fill, given the step's ``req_pool_indices`` and ``seq_lens`` (or the
# graph's copies of them).
Fill = Callable[[torch.Tensor, torch.Tensor], None]


class FillGraph:
    """The recorded fill of one binding, with the input buffers it reads.

    The first :meth:`run` fills with plain operations (that is also the
    warm-up the recording needs) and records the fill; every later run copies
    the inputs in and replays.
    """

    def __init__(self, what: str):
        self.what = what
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.req_pool_indices: Optional[torch.Tensor] = None
        self.seq_lens: Optional[torch.Tensor] = None

    def run(self, fill: Fill, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        if self.graph is not None and self._inputs_fit(req_pool_indices, seq_lens):
            self.req_pool_indices.copy_(req_pool_indices)
            self.seq_lens.copy_(seq_lens)
            self.graph.replay()
            return
        fill(req_pool_indices, seq_lens)
        if self.graph is None:
            self._record(fill, req_pool_indices, seq_lens)

    def _inputs_fit(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> bool:
        # A binding has one batch size, so the shapes always match; a caller
        # passing another dtype gets the plain fill rather than a silent cast.
        return req_pool_indices.dtype == self.req_pool_indices.dtype and seq_lens.dtype == self.seq_lens.dtype

    def _record(self, fill: Fill, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        from sgl_piecewise.runners.capture import shared_capture  # runners/ builds on backends/

        self.req_pool_indices = req_pool_indices.clone()
        self.seq_lens = seq_lens.clone()
        core = shared_capture(seq_lens.device)
        self.graph, _ = core.record(lambda: fill(self.req_pool_indices, self.seq_lens), self.what)


def can_record_fill(device: torch.device, masked: bool) -> bool:
    """Whether a bound fill on ``device`` may be recorded now (module docstring)."""
    return device.type == "cuda" and not masked and not torch.cuda.is_current_stream_capturing()
