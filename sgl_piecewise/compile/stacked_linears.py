"""A pass over the Dynamo graph, before the split: linears of one input whose
weights lie back to back in memory (a transformers layer's q/k/v and gate/up
projections, as ``models.adapt`` lays them out) become one
``ops.stacked_linear``, a matmul over them all, and a ``narrow`` of its output
for each. The op checks the layout again each time it runs, so a weight that
moves later gives the same result through one matmul each.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.fx
import torch.nn.functional as F

from sgl_piecewise.ops.linear_stack import one_block

logger = logging.getLogger("sgl_piecewise.compile")

_STACKED = torch.ops.sgl_piecewise.stacked_linear.default
# Uses of a linear's output that need its old (contiguous) strides.
_VIEWS = ("view", "view_as")
_REAL = (torch.Tensor, torch.nn.Parameter)


def stack_linears(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Rewrite ``gm`` in place; the number of stacks made."""
    inputs = {node: value for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)}
    by_input: Dict[torch.fx.Node, List[torch.fx.Node]] = {}
    for node in gm.graph.find_nodes(op="call_function", target=F.linear):
        if _weights_are_inputs(node, inputs):
            by_input.setdefault(node.args[0], []).append(node)
    made = 0
    for linears in by_input.values():
        for run in _back_to_back_runs(linears, inputs):
            if _views_still_hold(run):
                _stack(gm.graph, run)
                made += 1
    if made:
        gm.recompile()
        logger.debug("%d groups of linears of one input stacked into one matmul each", made)
    return made


def _operands(node: torch.fx.Node) -> Optional[tuple]:
    """``(x, weight, bias or None)`` of ``linear(x, weight[, bias])``, or None for another spelling."""
    if len(node.args) not in (2, 3) or set(node.kwargs) - {"bias"}:
        return None
    x, weight, *rest = node.args
    return x, weight, rest[0] if rest else node.kwargs.get("bias")


def _weights_are_inputs(node: torch.fx.Node, inputs: dict) -> bool:
    """``linear(x, weight[, bias])`` with a real tensor input as weight and bias."""
    operands = _operands(node)
    if operands is None or not isinstance(operands[0], torch.fx.Node):
        return False
    # Plain tensors only: a fake or meta input has no memory layout to read.
    return all(arg is None or (type(inputs.get(arg)) in _REAL and not inputs[arg].is_meta) for arg in operands[1:])


def _params(node: torch.fx.Node, inputs: dict) -> tuple:
    """``(weight, bias or None)`` of a linear node, as the real tensors."""
    _, weight, bias = _operands(node)
    return inputs[weight], (inputs[bias] if bias is not None else None)


def _back_to_back_runs(linears: List[torch.fx.Node], inputs: dict) -> List[List[torch.fx.Node]]:
    """The linears, in memory order, cut into runs of two or more whose
    weights are one block and whose biases are all present or all absent."""
    if len(linears) < 2:
        return []

    def where(node):
        weight = _params(node, inputs)[0]
        return weight.untyped_storage().data_ptr(), weight.storage_offset()

    ordered = sorted(linears, key=where)
    runs, run = [], [ordered[0]]
    for node in ordered[1:]:
        if _continues(run, node, inputs):
            run.append(node)
        else:
            runs.append(run)
            run = [node]
    runs.append(run)
    return [run for run in runs if len(run) > 1]


def _continues(run: List[torch.fx.Node], node: torch.fx.Node, inputs: dict) -> bool:
    (last_weight, last_bias), (weight, bias) = _params(run[-1], inputs), _params(node, inputs)
    return (last_bias is None) == (bias is None) and one_block([last_weight, weight]) is not None


def _views_still_hold(run: List[torch.fx.Node]) -> bool:
    """Each ``.view`` of a linear's output still works on its slice of the
    stacked output (a column slice: not contiguous)."""
    total = sum(node.meta["example_value"].shape[-1] for node in run)
    for node in run:
        value = node.meta["example_value"]
        part = value.new_empty(*value.shape[:-1], total)[..., : value.shape[-1]]
        for user in node.users:
            if user.op != "call_method" or user.target not in _VIEWS:
                continue
            args, kwargs = torch.fx.node.map_arg((user.args[1:], user.kwargs), _example_value)
            try:
                getattr(part, user.target)(*args, **kwargs)
            except (RuntimeError, ValueError):  # torch's refs raise ValueError
                return False
    return True


def _example_value(node: torch.fx.Node) -> Any:
    return node.meta["example_value"]


def _stack(graph: torch.fx.Graph, run: List[torch.fx.Node]) -> None:
    members = set(run)
    first = next(node for node in graph.nodes if node in members)  # the stack goes before its first use
    x = first.args[0]
    operands = [_operands(node) for node in run]
    weights = [weight for _, weight, _ in operands]
    biases = [bias for _, _, bias in operands] if operands[0][2] is not None else []
    with graph.inserting_before(first):
        stacked = graph.call_function(_STACKED, (x, weights, biases))
        stacked.meta.update(first.meta)
        stacked.meta["example_value"] = _STACKED(*torch.fx.node.map_arg((x, weights, biases), _example_value))
        parts, start = [], 0
        for node in run:
            width = node.meta["example_value"].shape[-1]
            part = graph.call_function(torch.narrow, (stacked, -1, start, width))
            part.meta.update(node.meta)
            part.meta["example_value"] = torch.narrow(stacked.meta["example_value"], -1, start, width)
            parts.append(part)
            start += width
    for node, part in zip(run, parts):  # after the inserts: the first linear was their place
        node.replace_all_uses_with(part)
        graph.erase_node(node)
