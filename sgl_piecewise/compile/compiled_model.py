"""``CompiledModel``: ``torch.compile(model, backend=sgl_piecewise)`` with the
token axis marked dynamic, so no token count recompiles."""

from __future__ import annotations

from typing import Any, Optional

import torch

from sgl_piecewise.compile.backend import SglPiecewiseBackend
from sgl_piecewise.compile.options import CompileOptions


def mark_token_axis(*tensors: torch.Tensor) -> None:
    """Make dim 0 dynamic for Dynamo without 0/1 specialisation (no recompile at 1 token)."""
    for t in tensors:
        torch._dynamo.decorators.mark_unbacked(t, 0)


class CompiledModel:
    """``forward(input_ids, positions)`` of ``model`` compiled by the
    ``sgl_piecewise`` backend with ``options``; the first call marks the token
    axis of its inputs (Dynamo keeps that for every later call)."""

    def __init__(self, model: torch.nn.Module, options: Optional[CompileOptions] = None):
        self.backend = SglPiecewiseBackend(options or CompileOptions())
        self.compiled = torch.compile(model, backend=self.backend, fullgraph=True)
        self._marked = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        if not self._marked:
            mark_token_axis(input_ids, positions)
            self._marked = True
        return self.compiled(input_ids, positions)
