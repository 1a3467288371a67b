"""``CompiledModel``: ``torch.compile(model, backend=sgl_piecewise)`` with the
token axis marked dynamic, so no token count recompiles (``token_guards.py``
says how)."""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from sgl_piecewise.compile.backend import SglPiecewiseBackend
from sgl_piecewise.compile.counters import counters
from sgl_piecewise.compile.options import CompileOptions
from sgl_piecewise.compile.token_guards import (
    MAX_TRACED_TOKENS,
    TokenShapeGuards,
    mark_token_axis_backed,
    size_oblivious_tracing,
)
from sgl_piecewise.errors import UnsupportedModeError


def mark_token_axis(*tensors: torch.Tensor) -> None:
    """Make dim 0 dynamic for Dynamo without 0/1 specialisation (no recompile
    at 1 token), for a model you ``torch.compile`` yourself: unbacked, so no
    guard names the token count. ``CompiledModel`` marks it its own way,
    which fuses more (``token_guards.py``)."""
    for t in tensors:
        torch._dynamo.decorators.mark_unbacked(t, 0)


class CompiledModel:
    """``forward(input_ids, positions)`` of ``model`` compiled by the
    ``sgl_piecewise`` backend with ``options``; the first call marks the token
    axis of its inputs backed (Dynamo keeps that for every later call), every
    call traces size-obliviously, and the shape guards that only bound the
    token count are dropped (``token_guards.py``): one graph for every token
    count, 1 included, with Inductor's fusions of a backed size. A call of
    more than ``MAX_TRACED_TOKENS`` (65536) tokens runs the model uncompiled,
    counted in ``counters.eager_fallbacks``.

    The model must trace as one graph (``fullgraph=True``): a graph break
    raises ``UnsupportedModeError`` naming its cause and place.
    """

    def __init__(self, model: torch.nn.Module, options: Optional[CompileOptions] = None):
        self.model = model
        self.backend = SglPiecewiseBackend(options or CompileOptions())
        self.token_guards = self.backend.token_guards = TokenShapeGuards()
        self.compiled = torch.compile(
            model, backend=self.backend, fullgraph=True, options={"guard_filter_fn": self.token_guards}
        )
        self._marked = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        if input_ids.shape[0] > MAX_TRACED_TOKENS:  # the trace's bound (token_guards.py)
            counters.fallback(f"{input_ids.shape[0]} tokens: above the compiled graph's {MAX_TRACED_TOKENS}")
            return self.model(input_ids, positions)
        if not self._marked:
            mark_token_axis_backed(input_ids, positions)
            self._marked = True
        try:
            with size_oblivious_tracing():
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
