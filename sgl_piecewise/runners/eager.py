"""A step's model run with eager attention metadata: the eager path of
every step, and the piecewise graphs' (which pad the tokens themselves)."""

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
    """``forward(input_ids, positions)`` on ``batch``'s real tokens with eager
    attention metadata: hidden states ``[num_tokens, H]``. ``batch`` has been
    validated by the caller."""
    backend.init_forward_metadata(batch, check=False)
    n = batch.num_tokens
    ids, positions = batch.input_ids[:n], batch.positions[:n]
    # A compiled forward then traces one graph for every token count (1
    # included) from its first call: no recompile, and the first call's
    # graph already has a token axis to pad for graphs. CompiledModel
    # marks the axis itself, its own way (compile/token_guards.py).
    if not isinstance(forward, CompiledModel):
        mark_token_axis(ids, positions)
    with forward_context(batch, backend, check=False, debug_checks=debug_checks):
        return forward(ids, positions)
