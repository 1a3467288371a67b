"""``PiecewiseCudaGraphRunner``: a ``ModelRunner``'s model compiled by the
``sgl_piecewise`` backend, which captures the pieces itself; this runner
drives a dummy step per capture size, largest first."""

from __future__ import annotations

import contextlib
import time
from typing import Optional, Sequence

import torch

from sgl_piecewise.compile.compiled_model import CompiledModel
from sgl_piecewise.compile.options import CompileOptions
from sgl_piecewise.compile.piece_graphs import outputs_unused
from sgl_piecewise.context import forward_context
from sgl_piecewise.errors import InvalidInputError, UnsupportedModeError
from sgl_piecewise.forward import ForwardBatch, ForwardMode
from sgl_piecewise.graphs.capture import shared_capture
from sgl_piecewise.graphs.fill_graphs import reserve_eager_bindings
from sgl_piecewise.memory import DUMMY_SLOT
from sgl_piecewise.runners.eager import run_model
from sgl_piecewise.runners.protocols import GraphHost


class PiecewiseCudaGraphRunner:
    """The compiled model's piecewise graphs, which a ``ModelRunner`` serves
    steps from once handed to its ``use_graphs`` (as its ``token_graphs``)."""

    name = "piecewise"
    axis = "tokens"  # use_graphs installs it as token_graphs

    def __init__(self, model_runner: GraphHost, options: Optional[CompileOptions] = None):
        self.model_runner = model_runner
        self.options = options or CompileOptions(cudagraphs=True)
        if not self.options.cudagraphs:
            raise InvalidInputError("options.cudagraphs: expected True (this runner captures graphs), got False")
        self.compiled = CompiledModel(model_runner.model, self.options)
        self.max_size = self.options.capture_sizes[-1]
        self.captured = False
        self.first_size_seconds = 0.0  # the largest size's share, the trace and compiles included
        reserve_eager_bindings(model_runner.backend, model_runner.req_to_token_pool.max_reqs, self.max_size)

    def capture(self, progress: bool = True, sizes: Optional[Sequence[int]] = None) -> float:
        """Compile and capture ``sizes`` (default: every capture size), largest
        first; return the seconds it took. A size left out is captured at first
        use. A graph break raises ``UnsupportedModeError`` naming it."""
        sizes = self._check_sizes(sizes)
        start = time.perf_counter()
        core = shared_capture(self.model_runner.device)
        sizes = core.largest_first(sizes, "capturing piecewise graphs", "size", progress)
        with contextlib.closing(sizes):  # a failure thaws gc at once
            for i, size in enumerate(sizes):
                try:
                    self._dummy_forward(size)
                except UnsupportedModeError as exc:
                    raise UnsupportedModeError(f"piecewise graphs: {exc}") from exc
                if i == 0:
                    core.synchronize()
                    self.first_size_seconds = time.perf_counter() - start
        self.captured = True
        return time.perf_counter() - start

    def padded_size(self, num_tokens: int) -> Optional[int]:
        """The size ``num_tokens`` replays at, or None (before ``capture``, or above the largest)."""
        return self.options.padded_size(num_tokens) if self.captured and num_tokens >= 1 else None

    def replay(self, batch: ForwardBatch, padded: int) -> torch.Tensor:
        """Hidden states of ``batch`` through the compiled model, which pads it itself."""
        mr = self.model_runner
        return run_model(self.compiled, batch, mr.backend, mr.debug_checks)

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
        """``num_tokens`` new tokens on the dummy slot, over as few requests as the context allows."""
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
            mr.backend.init_forward_metadata(batch, check=False)  # every token on the dummy slot
            with forward_context(batch, mr.backend, check=False), outputs_unused():
                self.compiled(batch.input_ids, batch.positions)
        finally:
            mr.req_to_token_pool.free(rows)
