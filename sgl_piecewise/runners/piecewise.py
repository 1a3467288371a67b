"""``PiecewiseCudaGraphRunner``: a ``ModelRunner``'s model, compiled by the
``sgl_piecewise`` backend, with every capture size captured up front.

The backend's own wrapper does the capturing (one place, not two); this
runner only drives it: it compiles with the token axis marked dynamic
(unbacked, so sizes 0 and 1 share the graph too), and calls the compiled
model once per capture size through the capture core (``capture.py``):
largest first — so smaller sizes reuse the pool memory the largest one
reserved — with Python's gc frozen and a progress bar.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch

from sgl_piecewise.compile.compiled_model import CompiledModel
from sgl_piecewise.compile.options import CompileOptions
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.forward import ForwardBatch, ForwardMode, forward_context
from sgl_piecewise.memory import DUMMY_SLOT
from sgl_piecewise.runners.capture import shared_capture


class PiecewiseCudaGraphRunner:
    """Installs the compiled model into ``model_runner.model_forward``."""

    def __init__(self, model_runner: Any, options: Optional[CompileOptions] = None):
        self.model_runner = model_runner
        self.options = options or CompileOptions(cudagraphs=True)
        self.compiled = CompiledModel(model_runner.model, self.options)
        model_runner.model_forward = self.compiled
        self.first_size_seconds = 0.0

    def capture(self, progress: bool = True, sizes: Optional[Sequence[int]] = None) -> float:
        """Compile and capture ``sizes`` (default: every capture size),
        largest first; return the seconds it took.

        A capture size left out is captured lazily, the first time a step
        pads to it (inside that step): capture the sizes a deployment uses
        most up front and let rare ones wait, for a shorter start.
        ``self.first_size_seconds`` keeps the share of the first (largest) size,
        which includes Dynamo's trace and the piece compiles.
        """
        sizes = self._check_sizes(sizes)
        start = time.perf_counter()
        core = shared_capture(self.model_runner.device)
        sizes = core.largest_first(sizes, "capturing piecewise graphs", "size", progress)
        for i, size in enumerate(sizes):
            self._dummy_forward(size)
            if i == 0:
                core.synchronize()
                self.first_size_seconds = time.perf_counter() - start
        return time.perf_counter() - start

    def _check_sizes(self, sizes: Optional[Sequence[int]]) -> Sequence[int]:
        if sizes is None:
            return self.options.capture_sizes
        unknown = sorted(set(sizes) - set(self.options.capture_sizes))
        if unknown or not sizes:
            raise InvalidInputError(
                f"sizes: expected a non-empty subset of the capture sizes {list(self.options.capture_sizes)}, "
                f"got {list(sizes)}"
            )
        return sizes

    @torch.no_grad()
    def _dummy_forward(self, num_tokens: int) -> None:
        """``num_tokens`` new tokens, every one writing the dummy slot, spread
        over as few requests as the context allows (a request holds at most
        ``max_context_len`` tokens)."""
        mr = self.model_runner
        device = mr.device
        context = mr.max_context_len
        extend = [context] * (num_tokens // context) + ([num_tokens % context] if num_tokens % context else [])
        if len(extend) > mr.req_to_token_pool.available:
            raise InvalidInputError(
                f"capture of {num_tokens} tokens: expected room for {len(extend)} requests of at most "
                f"{context} tokens, got {mr.req_to_token_pool.available} free request rows; raise "
                f"max_reqs or max_context_len, or lower the largest capture size"
            )
        rows = mr.req_to_token_pool.alloc(len(extend))
        try:
            batch = ForwardBatch.build(
                ForwardMode.EXTEND,
                torch.zeros(num_tokens, dtype=torch.int64, device=device),
                torch.tensor(rows, dtype=torch.int64),
                [0] * len(extend),
                extend,
                torch.full((num_tokens,), DUMMY_SLOT, dtype=torch.int64),
            )
            mr.backend.init_forward_metadata(batch)
            # check=False: every token writing the dummy slot is the point here.
            with forward_context(batch, mr.backend, check=False):
                self.compiled(batch.input_ids, batch.positions)
        finally:
            mr.req_to_token_pool.free(rows)
