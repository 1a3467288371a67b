"""``CompiledModel``: ``torch.compile(model, backend=sgl_piecewise)`` with the
token axis marked dynamic, so no token count recompiles."""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from sgl_piecewise.compile.backend import SglPiecewiseBackend
from sgl_piecewise.compile.options import CompileOptions
from sgl_piecewise.errors import UnsupportedModeError


def mark_token_axis(*tensors: torch.Tensor) -> None:
    """Make dim 0 dynamic for Dynamo without 0/1 specialisation (no recompile at 1 token)."""
    for t in tensors:
        torch._dynamo.decorators.mark_unbacked(t, 0)


class CompiledModel:
    """``forward(input_ids, positions)`` of ``model`` compiled by the
    ``sgl_piecewise`` backend with ``options``; the first call marks the token
    axis of its inputs (Dynamo keeps that for every later call).

    The model must trace as one graph (``fullgraph=True``): a graph break
    raises ``UnsupportedModeError`` naming its cause and place.
    """

    def __init__(self, model: torch.nn.Module, options: Optional[CompileOptions] = None):
        self.backend = SglPiecewiseBackend(options or CompileOptions())
        self.compiled = torch.compile(model, backend=self.backend, fullgraph=True)
        self._marked = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        if not self._marked:
            mark_token_axis(input_ids, positions)
            self._marked = True
        try:
            return self.compiled(input_ids, positions)
        except torch._dynamo.exc.Unsupported as exc:  # raised while tracing, never on a traced call
            raise UnsupportedModeError(
                f"torch.compile: expected a model Dynamo traces as one graph, got a graph break: "
                f"{graph_break_reason(exc)}; run it without the compiler (graphs='breakable': CUDA "
                f"graphs broken at attention) or remove the break"
            ) from exc


def graph_break_reason(exc: BaseException) -> str:
    """Dynamo's reason for a graph break in one line: what, and where in the user's code."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    what = lines[0] if lines else type(exc).__name__
    places = [i for i, line in enumerate(lines) if re.match(r'File ".*", line \d+', line)]
    if not places:
        return what
    i = places[-1]  # the innermost frame of the user's code
    where = re.sub(r'^File "(.*)", line (\d+), in (.*)$', r"\1:\2 in \3", lines[i])
    code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("^") else ""
    return f"{what} at {where}" + (f": `{code}`" if code else "")
