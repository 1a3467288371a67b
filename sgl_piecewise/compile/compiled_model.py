"""``CompiledModel``: ``torch.compile(model, backend=sgl_piecewise)`` with no
recompile per token count (``token_guards.py``) and calls without Dynamo once
compiled (``direct_call.py``, ``precompiled.py``)."""

from __future__ import annotations

import contextlib
import logging
import operator
import re
from typing import Any, List, Optional, Sequence, Tuple

import torch

from sgl_piecewise.compile import precompiled
from sgl_piecewise.compile.backend import PiecewiseModule, SglPiecewiseBackend
from sgl_piecewise.compile.direct_call import GraphInputs, LastInputs
from sgl_piecewise.compile.options import CompileOptions
from sgl_piecewise.compile.token_guards import (
    MAX_TRACED_TOKENS,
    TokenShapeGuards,
    mark_token_axis_backed,
    size_oblivious_tracing,
)
from sgl_piecewise.errors import StaleGraphError, UnsupportedModeError
from sgl_piecewise.graphs.counters import counters
from sgl_piecewise.internals import dynamo_backend
from sgl_piecewise.regions import tracing_regions

logger = logging.getLogger("sgl_piecewise.compile")


def mark_token_axis(*tensors: torch.Tensor) -> None:
    """Make dim 0 dynamic (unbacked: no recompile at 1 token) for a model you
    ``torch.compile`` yourself; ``CompiledModel`` marks it backed, which fuses more."""
    for t in tensors:
        torch._dynamo.decorators.mark_unbacked(t, 0)


class CompiledModel:
    """``forward(input_ids, positions)`` of ``model`` compiled by the
    ``sgl_piecewise`` backend: one graph for every token count up to
    ``MAX_TRACED_TOKENS`` (larger calls run uncompiled, counted in
    ``counters.eager_fallbacks``).

    Unless ``options.dynamo_guards``, calls after the compile skip Dynamo:
    the model's Python state (a module attribute ``forward`` reads, a hook)
    is read once, at the compile; change it and build a new ``CompiledModel``.
    A graph break raises ``UnsupportedModeError`` naming its cause and place.
    """

    def __init__(self, model: torch.nn.Module, options: Optional[CompileOptions] = None):
        self.model = model
        self.options = options or CompileOptions()
        self.token_guards = TokenShapeGuards()
        self.backend = SglPiecewiseBackend(self.options, token_guards=self.token_guards)
        self.compiled = torch.compile(
            model, backend=self.backend, fullgraph=True, options={"guard_filter_fn": self.token_guards}
        )
        self._marked = False
        # Piecewise modules called without Dynamo: a saved one and those compiled here.
        self._looked_up = not (self.options.cache_dir and _direct_calls_on(self.options))
        self._direct: List[_DirectCall] = []
        self._save_key: Optional[str] = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        args = (input_ids, positions)
        if input_ids.shape[0] > MAX_TRACED_TOKENS:
            counters.fallback(f"{input_ids.shape[0]} tokens: above the compiled graph's {MAX_TRACED_TOKENS}")
            return self.model(*args)
        if not self._looked_up:
            self._looked_up = True
            direct, self._save_key = self._look_up(args)
            self._direct += [direct] if direct is not None else []
        for direct in self._direct:
            if direct.inputs.accepts(args):
                try:
                    return direct(self.model, args)
                except StaleGraphError as exc:  # raised before the call returned; traced, it runs whole
                    logger.warning("compiled graph no longer matches the model (%s); tracing afresh", exc)
                    self._direct.remove(direct)
                    break
        compiled_before = len(self.backend.modules)
        result = self._traced(args)
        if len(self.backend.modules) > compiled_before:
            self._after_compile(self.backend.modules[-1], args, result)
        return result

    @property
    def piecewise_modules(self) -> list:
        """Every ``PiecewiseModule`` this model runs, compiled or loaded."""
        loaded = [d.module for d in self._direct if d.module not in self.backend.modules]
        return [*self.backend.modules, *loaded]

    def _traced(self, args) -> Any:
        """The call through Dynamo (which compiles on its first call)."""
        if not self._marked:
            mark_token_axis_backed(*args)
            self._marked = True
        direct = _direct_calls_on(self.options)
        calling = self.backend.calling(self.model, args) if direct else contextlib.nullcontext()
        try:
            with calling, size_oblivious_tracing(), _regions(direct):
                return self.compiled(*args)
        except dynamo_backend.GraphBreak as exc:  # raised while tracing, never on a traced call
            raise UnsupportedModeError(
                f"torch.compile: expected a model Dynamo traces as one graph, got a graph break: "
                f"{graph_break_reason(exc)}; run it without the compiler (graphs='breakable': CUDA "
                f"graphs broken at attention) or remove the break"
            ) from exc

    def _look_up(self, args) -> tuple:
        """(the saved compile to call, or None; the key to save under, or None)."""
        key = precompiled.model_key(self.model, args, self.options)
        saved = precompiled.load_entry(self.options.cache_dir, key)
        if saved is None:
            return None, key
        changed = precompiled.changed_constant(saved.constants, self.model, args)
        if changed is not None:
            logger.info("saved compile %s is stale: %s; tracing afresh", key, changed)
            return None, key
        artifacts = precompiled.load_pieces(self.options.cache_dir, key, saved)
        if artifacts is None:
            return None, key
        try:
            direct = _DirectCall.from_saved(saved, artifacts, self.model, args, self.options)
        except Exception as exc:  # a damaged entry costs a trace, never a failure
            logger.warning("saved compile %s: expected one to rebuild, got %s; tracing afresh", key, exc)
            return None, key
        counters.compiles_loaded += 1
        return direct, None

    def _after_compile(self, module: PiecewiseModule, args, result: Any) -> None:
        """From now on call ``module`` directly (and save it), if it replays without Dynamo."""
        outputs, module.last_outputs, module.keep_outputs = module.last_outputs or (), None, False
        if module.direct_inputs is None:  # the backend said why
            return
        output, why_not = self._direct_output(args, result, outputs)
        if why_not is not None:
            logger.info("graph not callable without Dynamo: %s", why_not)
            module.to_save = None
            return
        last_inputs = LastInputs(module.direct_inputs.inputs, self.model)
        self._direct.append(_DirectCall(module, module.direct_inputs, output, last_inputs))
        if self._save_key is not None and module.to_save is not None:
            self._save(self._save_key, module, output)
        self._save_key = None

    def _direct_output(self, args, result: Any, outputs: Sequence[Any]) -> Tuple[Optional[str], Optional[str]]:
        """(how the call returns the graph's outputs, "first" or "tuple"; or why Dynamo must stay)."""
        if self.token_guards.kept_reason is not None:  # Dynamo would retrace other token counts
            return None, f"the graph holds only for some token counts ({self.token_guards.kept_reason})"
        if self.token_guards.constants is None:
            return None, "this torch reports no guard values"
        unreadable = precompiled.changed_constant(tuple(self.token_guards.constants), self.model, args)
        if unreadable is not None:
            return None, unreadable
        if len(outputs) == 1 and result is outputs[0]:
            return "first", None
        if isinstance(result, tuple) and len(result) == len(outputs) and all(map(operator.is_, result, outputs)):
            return "tuple", None
        return None, "the call returns more than the graph's outputs"

    def _save(self, key: str, module: PiecewiseModule, output: str) -> None:
        """Save the compile for a start without Dynamo (``precompiled.py``)."""
        saved, artifacts = module.to_save
        module.to_save = None
        if len(self.backend.modules) != 1:  # the key names the model, not one of its graphs
            return
        saved.constants, saved.output = tuple(self.token_guards.constants), output
        try:
            precompiled.save(self.options.cache_dir, key, saved, artifacts)
        except Exception as exc:  # the step's result stands; a later process traces instead
            logger.warning("compile not saved to %s: %s", self.options.cache_dir, exc)
            return
        counters.compiles_saved += 1


def _direct_calls_on(options: CompileOptions) -> bool:
    """Only piecewise graphs check each new set of weights against the trace."""
    return options.split_graph and options.cudagraphs and not options.dynamo_guards


def _regions(direct_calls: bool):
    """A layer's code traced once (``regions.py``), only where later calls skip
    Dynamo: its guards would miss a stamped-out region's changed attribute."""
    return tracing_regions() if direct_calls else contextlib.nullcontext()


class _DirectCall:
    """A piecewise module called without Dynamo (``direct_call.py``)."""

    def __init__(self, module: PiecewiseModule, inputs: GraphInputs, output: str, last_inputs: LastInputs):
        self.module, self.inputs, self.output, self.last_inputs = module, inputs, output, last_inputs

    @classmethod
    def from_saved(cls, saved, artifacts, model, args, options) -> "_DirectCall":
        last_inputs = LastInputs(saved.inputs.inputs, model)
        inputs, _ = last_inputs.fetch(model, args)
        module = PiecewiseModule.from_saved(saved, artifacts, inputs, options)
        return cls(module, saved.inputs, saved.output, last_inputs)

    def __call__(self, model: torch.nn.Module, args) -> Any:
        inputs, reused = self.last_inputs.fetch(model, args)
        out = self.module(*inputs)
        # Checked once the graphs are launched: a weight assigned since the
        # last call runs the call again on the model's own weights.
        if reused and not self.last_inputs.current(model, inputs):
            counters.steps_rerun += 1
            inputs, _ = self.last_inputs.fetch(model, args)
            out = self.module(*inputs)
        return out[0] if self.output == "first" else tuple(out)


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
