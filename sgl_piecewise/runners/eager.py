"""A step's model run with eager attention metadata: the eager path, and the piecewise graphs'."""

from __future__ import annotations

from typing import Callable

import torch

from sgl_piecewise.backends.base import AttentionBackend
from sgl_piecewise.compile.compiled_model import CompiledModel, mark_token_axis
from sgl_piecewise.context import forward_context
from sgl_piecewise.forward import ForwardBatch

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def run_model(
    forward: Forward, batch: ForwardBatch, backend: AttentionBackend, debug_checks: bool = False
) -> torch.Tensor:
    """Hidden states ``[num_tokens, H]`` of ``forward`` on ``batch``'s real tokens (validated)."""
    backend.init_forward_metadata(batch, check=False)
    n = batch.num_tokens
    ids, positions = batch.input_ids[:n], batch.positions[:n]
    # One trace for every token count from the first call; CompiledModel marks its own.
    if not isinstance(forward, CompiledModel):
        mark_token_axis(ids, positions)
    with forward_context(batch, backend, check=False, debug_checks=debug_checks):
        return forward(ids, positions)
