"""Call a compiled Dynamo graph without Dynamo.

Dynamo turns ``model(*args)`` into a call of its graph on a flat list of
inputs: the call's tensors, the token count, and the model's parameters and
buffers. When every input is one of these, and the trace had no side
effects and returns the graph's outputs as they are, that call can be made
directly: ``GraphInputs`` records where each input comes from, and
``gather`` is generated Python that fetches them (one dict lookup per module
level, no string parsing per call).

This is what lets a warm start skip Dynamo's trace (``precompiled.py``).
What Dynamo's guards would check per call is then checked here: the call's
tensors (dtype, rank, device) and the grad mode. The model's parameters
are the last call's (``LastInputs``), dropped when one is assigned and
compared with the model's own after the call has launched its graphs;
``PiecewiseModule`` checks the shape, stride, dtype and device of every
new set of them against the trace (``errors.StaleGraphError``). The rest
of the model's Python state is checked once, when the saved compile is
looked up: its modules' plain attributes are part of the key, and
Dynamo's guards on constants are evaluated again
(``precompiled.changed_constant``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch


@dataclass(frozen=True)
class GraphInput:
    """Where one graph input comes from: ``("arg", i)``: the call's argument
    ``i``; ``("tokens", i)``: dim 0 of argument ``i``; ``("param" | "buffer",
    name)``: the model's parameter or buffer ``name``."""

    kind: str
    where: Union[int, str]


@dataclass(frozen=True)
class ArgSpec:
    """What the trace assumed of one tensor argument of the call."""

    dtype: torch.dtype
    dim: int
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> "ArgSpec":
        return cls(t.dtype, t.dim(), t.device)

    def matches(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.dtype == self.dtype and t.dim() == self.dim and t.device == self.device


@dataclass(frozen=True)
class GraphInputs:
    """How to call a graph from ``model(*args)``, and what the trace assumed."""

    inputs: Tuple[GraphInput, ...]
    args: Tuple[ArgSpec, ...]
    grad_enabled: bool

    def accepts(self, args: Sequence[Any]) -> bool:
        """Would Dynamo's guards let this call run the traced graph (as far
        as the call, not the model, decides)?"""
        return (
            len(args) == len(self.args)
            and torch.is_grad_enabled() == self.grad_enabled
            and all(spec.matches(a) for spec, a in zip(self.args, args))
        )


def describe_inputs(
    example_inputs: Sequence[Any], model: torch.nn.Module, args: Sequence[Any], token_axis: Any
) -> Union[GraphInputs, str]:
    """Where each of Dynamo's example inputs comes from, or why one cannot be
    found (a tensor that is no argument, parameter or buffer, such as a
    global; a SymInt other than the token count). ``token_axis``: the graph's
    ``TokenAxis``."""
    if not all(isinstance(a, torch.Tensor) for a in args):
        return "the call has arguments other than tensors"
    owners: Dict[int, GraphInput] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), GraphInput("param", name))
    for name, b in model.named_buffers(remove_duplicate=False):
        owners.setdefault(id(b), GraphInput("buffer", name))
    for i, a in enumerate(args):
        owners[id(a)] = GraphInput("arg", i)
    token_args = [owners[id(example_inputs[i])].where for i in token_axis.tensor_inputs
                  if owners.get(id(example_inputs[i]), GraphInput("", 0)).kind == "arg"]  # fmt: skip
    inputs = []
    for i, x in enumerate(example_inputs):
        if i in token_axis.symint_inputs and token_args:
            inputs.append(GraphInput("tokens", token_args[0]))
        elif isinstance(x, torch.Tensor) and id(x) in owners:
            inputs.append(owners[id(x)])
        else:
            return f"graph input {i} ({type(x).__name__}) is no argument, token count, parameter or buffer of the model"
    return GraphInputs(tuple(inputs), tuple(ArgSpec.of(a) for a in args), torch.is_grad_enabled())


def make_gather(inputs: Sequence[GraphInput]) -> Callable[[torch.nn.Module, Sequence[Any]], List[Any]]:
    """``gather(model, args)``: the graph's inputs, as generated Python."""
    lines: List[str] = []
    module_vars: Dict[Tuple[str, ...], str] = {(): "model"}

    def module_var(path: Tuple[str, ...]) -> str:
        if path not in module_vars:
            parent = module_var(path[:-1])
            module_vars[path] = f"m{len(module_vars)}"
            lines.append(f"    {module_vars[path]} = {parent}._modules[{path[-1]!r}]")
        return module_vars[path]

    values = []
    for source in inputs:
        if source.kind == "arg":
            values.append(f"args[{source.where}]")
        elif source.kind == "tokens":
            values.append(f"args[{source.where}].shape[0]")
        else:
            *path, leaf = source.where.split(".")
            table = "_parameters" if source.kind == "param" else "_buffers"
            values.append(f"{module_var(tuple(path))}.{table}[{leaf!r}]")
    body = "\n".join(lines + [f"    return [{', '.join(values)}]"])
    namespace: Dict[str, Any] = {}
    exec(compile(f"def gather(model, args):\n{body}\n", "<sgl_piecewise gather>", "exec"), namespace)
    return namespace["gather"]


class LastInputs:
    """A graph's inputs for ``model(*args)``, the model's tensors reused from
    the last call: fetching the 0.5B shape's 171 weights from the model
    takes 16 µs of host time on a CPU and more on a GPU's host, all of it
    before the first graph launches; reused, a call's inputs take 1 µs.

    A parameter, buffer or submodule assigned to one of the model's modules
    (``load_state_dict(assign=True)``, ``module.weight = ...``) drops them at
    once (torch's module registration hooks, ``graphs/weight_guard.py``), so
    replaced weights are not kept alive. A change no hook reports (a write
    into ``module._parameters``) is caught by :meth:`current`, which the
    caller runs after its graphs are launched, and which compares them with
    the model's: on False the caller runs the call again on :meth:`fetch`'s
    fresh inputs. A weight whose tensor got new storage (``.data =``, a
    device or dtype conversion) is the same tensor; its new address is the
    graphs' concern (``piece_graphs.StaticInputsMoved``)."""

    def __init__(self, inputs: Sequence[GraphInput], model: torch.nn.Module):
        from sgl_piecewise.graphs.weight_guard import watch_assignments  # runners/ builds on compile/

        self._gather = make_gather(inputs)
        self._weights = [i for i, source in enumerate(inputs) if source.kind in ("param", "buffer")]
        self._gather_weights = make_gather([inputs[i] for i in self._weights])
        # (input index, is the token count, argument index) of the call's own inputs
        own = [(i, source) for i, source in enumerate(inputs) if source.kind in ("arg", "tokens")]
        self._from_call = [(i, source.kind == "tokens", source.where) for i, source in own]
        self._last: Optional[List[Any]] = None  # the last inputs, the call's own left out
        watch_assignments(model, self)

    def fetch(self, model: torch.nn.Module, args: Sequence[Any]) -> Tuple[List[Any], bool]:
        """(the graph's inputs for this call, whether its weights are the last call's)."""
        if self._last is not None:
            inputs = list(self._last)
            for i, tokens, where in self._from_call:
                inputs[i] = args[where].shape[0] if tokens else args[where]
            return inputs, True
        inputs = self._gather(model, args)
        self._last = list(inputs)
        for i, _, _ in self._from_call:  # not kept alive past their call
            self._last[i] = None
        return inputs, False

    def current(self, model: torch.nn.Module, inputs: Sequence[Any]) -> bool:
        """Are ``inputs``' weights the model's own now? Forgets them if not."""
        same = all(map(operator.is_, self._gather_weights(model, ()), map(inputs.__getitem__, self._weights)))
        if not same:
            self._last = None
        return same

    def note_assignment(self, module: torch.nn.Module, name: str) -> None:
        """A parameter, buffer or submodule ``name`` was assigned to one of the model's modules."""
        self._last = None
