"""Call a compiled Dynamo graph without Dynamo: where every graph input is an
argument of the call, the token count, or a parameter or buffer of the model,
``GraphInputs`` records its source and ``make_gather`` generates the Python
that fetches them. docs/ARCHITECTURE.md, "Calls without Dynamo after the compile".
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from sgl_piecewise.graphs.weight_guard import watch_assignments


@dataclass(frozen=True)
class GraphInput:
    """``("arg", i)``, ``("tokens", i)`` (dim 0 of argument ``i``), or ``("param" | "buffer", name)``."""

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
        """Would Dynamo's guards on the call's arguments and grad mode pass?"""
        return (
            len(args) == len(self.args)
            and torch.is_grad_enabled() == self.grad_enabled
            and all(spec.matches(a) for spec, a in zip(self.args, args))
        )


def describe_inputs(
    example_inputs: Sequence[Any], model: torch.nn.Module, args: Sequence[Any], token_axis: Any
) -> Union[GraphInputs, str]:
    """Where each of Dynamo's example inputs comes from, or why one has no source."""
    if not all(isinstance(a, torch.Tensor) for a in args):
        return "the call has arguments other than tensors"
    owners: Dict[int, GraphInput] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), GraphInput("param", name))
    for name, b in model.named_buffers(remove_duplicate=False):
        owners.setdefault(id(b), GraphInput("buffer", name))
    for i, a in enumerate(args):
        owners[id(a)] = GraphInput("arg", i)
    token_args = [
        owners[id(example_inputs[i])].where
        for i in token_axis.tensor_inputs
        if owners.get(id(example_inputs[i]), GraphInput("", 0)).kind == "arg"
    ]
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
    the last call (fetching every weight costs host time before the first
    launch). An assignment the module hooks report drops them; one they miss
    is caught by :meth:`current`, which the caller runs after the launches."""

    def __init__(self, inputs: Sequence[GraphInput], model: torch.nn.Module):
        self._gather = make_gather(inputs)
        self._weights = [i for i, source in enumerate(inputs) if source.kind in ("param", "buffer")]
        self._gather_weights = make_gather([inputs[i] for i in self._weights])
        # (input index, is the token count, argument index)
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
        """Called by the module hooks on an assignment."""
        self._last = None
