"""Which inputs and outputs of a Dynamo graph run along the token axis: a
symbolic dim 0, the one dynamic size the backend pads. Any other dynamic size
turns graphs off for that graph (``TokenAxis.unsupported`` says why)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.fx


def _expr(value) -> Optional[object]:
    return value.node.expr if isinstance(value, torch.SymInt) else None


@dataclass(frozen=True)
class TokenAxis:
    tensor_inputs: tuple  # positions of inputs with the token axis at dim 0
    symint_inputs: tuple  # positions of SymInt inputs equal to the token count
    tensor_outputs: tuple  # positions of outputs with the token axis at dim 0
    unsupported: Optional[str]  # why graphs cannot pad this graph, if they cannot


def _placeholder_values(gm: torch.fx.GraphModule) -> List[object]:
    return [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]


def find_token_axis(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> TokenAxis:
    values = _placeholder_values(gm)
    symbols, tensors, unsupported = set(), [], None
    for i, (value, real) in enumerate(zip(values, example_inputs)):
        if not isinstance(value, torch.Tensor) or isinstance(real, torch.nn.Parameter):
            continue
        dynamic = [d for d, s in enumerate(value.shape) if isinstance(s, torch.SymInt)]
        if not dynamic:
            continue
        expr = _expr(value.shape[0])
        if dynamic != [0] or expr is None or not expr.is_Symbol:
            unsupported = f"input {i} has dynamic dims {dynamic} of shape {tuple(value.shape)}"
            continue
        symbols.add(expr)
        tensors.append(i)
    symints = []
    for i, value in enumerate(values):
        expr = _expr(value)
        if expr is None:
            continue
        if expr in symbols:
            symints.append(i)
        else:
            unsupported = unsupported or f"SymInt input {i} ({expr}) is not a token count"
    outputs = _token_outputs(gm, symbols)
    return TokenAxis(tuple(tensors), tuple(symints), outputs, unsupported)


def _token_outputs(gm: torch.fx.GraphModule, symbols: set) -> tuple:
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    results = output.args[0]
    results = results if isinstance(results, (tuple, list)) else (results,)
    positions = []
    for i, node in enumerate(results):
        value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
        if isinstance(value, torch.Tensor) and value.dim() and _expr(value.shape[0]) in symbols:
            positions.append(i)
    return tuple(positions)
