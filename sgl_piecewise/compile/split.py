"""Split a Dynamo graph around the splitting ops (attention, by default):
``to_out_variant`` makes attention write a buffer the piece before it
allocates (a static address in the pool), then ``split_graph``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, FrozenSet, List, Set, Tuple

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from sgl_piecewise.ops import attention as _attention_ops  # registers the ops

_FUNCTIONAL_ATTENTION = (
    torch.ops.sgl_piecewise.unified_attention,
    torch.ops.sgl_piecewise.unified_attention.default,
)
_OUT_ATTENTION = torch.ops.sgl_piecewise.unified_attention_with_output.default
_OP_PACKET = type(torch.ops.aten.mm)

_splitting_ops: Set[Callable] = {
    *_FUNCTIONAL_ATTENTION,
    torch.ops.sgl_piecewise.unified_attention_with_output,
    _OUT_ATTENTION,
}


def register_splitting_op(op: Callable) -> None:
    """Also split the graph around ``op`` (a custom op, packet or overload),
    registered before compiling: it runs eagerly between the graphed pieces."""
    if not callable(op):
        raise TypeError(f"register_splitting_op: expected a callable op, got {type(op).__name__}")
    _splitting_ops.add(op)
    if isinstance(op, _OP_PACKET):
        _splitting_ops.add(op.default)


def splitting_ops() -> FrozenSet[Callable]:
    return frozenset(_splitting_ops)


def _insert_output_buffer(graph: torch.fx.Graph, q: torch.fx.Node, v: torch.fx.Node) -> torch.fx.Node:
    """Nodes that allocate the attention output ``[T, Hq, Dv]`` like ``q``; aten
    ops only, since AOTAutograd's cache refuses a graph that calls Python."""
    q_val, v_val = q.meta["example_value"], v.meta["example_value"]
    sizes = [*q_val.shape[:-1], v_val.shape[-1]]
    owners = [q] * (len(sizes) - 1) + [v]
    dims = [*range(len(sizes) - 1), v_val.dim() - 1]
    shape = [
        s if isinstance(s, int) else graph.call_function(torch.ops.aten.sym_size.int, (owner, dim))
        for s, owner, dim in zip(sizes, owners, dims)
    ]
    return graph.call_function(
        torch.ops.aten.empty.memory_format, (shape,), {"dtype": q_val.dtype, "device": q_val.device}
    )


def to_out_variant(gm: torch.fx.GraphModule) -> int:
    """Rewrite functional attention calls to the out variant; return how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _FUNCTIONAL_ATTENTION:
            continue
        args = list(node.args) + [None] * (5 - len(node.args))
        q, k, v, layer_id, scale = args[:5]
        layer_id = node.kwargs.get("layer_id", layer_id)
        scale = node.kwargs.get("scale", scale)
        with gm.graph.inserting_before(node):
            out = _insert_output_buffer(gm.graph, q, v)
            out.meta = dict(node.meta)
            gm.graph.call_function(_OUT_ATTENTION, (q, k, v, out, layer_id, scale))
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        count += 1
    gm.recompile()
    return count


def bypass_dispatcher(piece: torch.fx.GraphModule) -> int:
    """Make a splitting piece call attention's implementation directly; return how
    many calls were redirected. Only for pieces that are never traced again."""
    count = 0
    for node in piece.graph.nodes:
        if node.op == "call_function" and node.target is _OUT_ATTENTION:
            node.target = _attention_ops.attention_with_output_direct
            count += 1
    if count:
        piece.recompile()
    return count


@dataclass(frozen=True)
class SplitItem:
    """One piece of a split graph."""

    name: str  # its attribute in the split module
    index: int
    is_splitting_op: bool
    graph: torch.fx.GraphModule


def split_graph(
    gm: torch.fx.GraphModule, ops: FrozenSet[Callable] | None = None
) -> Tuple[torch.fx.GraphModule, List[SplitItem]]:
    """Split ``gm`` so every splitting op sits alone in its own piece."""
    ops = splitting_ops() if ops is None else ops
    piece_of = {}
    splitting_ids = set()
    piece = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target in ops:
            piece += 1
            piece_of[node] = piece
            splitting_ids.add(piece)
            piece += 1
        else:
            piece_of[node] = piece
    # Attention mutates the KV cache and its output: ordering by data alone could run a reader first.
    split_gm = split_module(gm, None, lambda n: piece_of[n], keep_original_order=True)
    return split_gm, split_items(split_gm, {f"submod_{i}" for i in splitting_ids})


def split_items(split_gm: torch.fx.GraphModule, splitting: Set[str]) -> List[SplitItem]:
    """The pieces of a split module in call order; ``splitting``: those of a splitting op."""
    items = []
    for name, module in split_gm.named_children():
        index = int(name.rsplit("_", 1)[-1])
        items.append(SplitItem(name, index, name in splitting, module))
    items.sort(key=lambda item: item.index)
    return items
