"""An Inductor graph pass for the compiled pieces: a residual add stays an add.

In a piece the residual sum is also a graph output, so Inductor folds
``mm(x, w) + r`` into ``addmm(r, x, w)``, and cuBLAS copies the residual
before each such GEMM, kernels the model compiled whole does not launch.
:class:`UnfuseResidualAddmm` turns each back into ``mm`` then ``add``, which
also rounds as eager does; a bias ``addmm`` stays (no copy).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional, Tuple

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from sgl_piecewise.errors import InvalidTypeError
from sgl_piecewise.internals import inductor  # imports Inductor
from sgl_piecewise.internals.inductor import CustomGraphPass

logger = logging.getLogger("sgl_piecewise.compile")

_aten = torch.ops.aten


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Provably the same shape, adding no guard on a symbolic size."""
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


class UnfuseResidualAddmm(CustomGraphPass):
    """``addmm(r, x, w)`` -> ``mm(x, w) + r`` where ``r`` has the output's
    shape and the output is on one of ``devices``; ``beta``/``alpha`` 1."""

    def __init__(self, devices: Tuple[str, ...] = ("cuda",)):
        if isinstance(devices, str) or not all(isinstance(d, str) for d in devices):
            raise InvalidTypeError(f"devices: expected a tuple of device types such as ('cuda',), got {devices!r}")
        self.devices = tuple(devices)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if self._residual_addmm(node):
                self._unfuse(graph, node)

    def _residual_addmm(self, node: torch.fx.Node) -> bool:
        if node.op != "call_function" or node.target is not _aten.addmm.default or len(node.args) != 3:
            return False
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return False
        inp = node.args[0]
        out_val = node.meta.get("val")
        inp_val = inp.meta.get("val") if isinstance(inp, torch.fx.Node) else None
        return (
            isinstance(out_val, torch.Tensor)
            and isinstance(inp_val, torch.Tensor)
            and out_val.device.type in self.devices
            and inp_val.dtype == out_val.dtype
            and _same_shape(inp_val, out_val)
        )

    @staticmethod
    def _unfuse(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
        residual, mat1, mat2 = node.args
        a, b = mat1.meta["val"], mat2.meta["val"]
        with graph.inserting_before(node):
            product = graph.call_function(_aten.mm.default, (mat1, mat2))
            with _fake_mode_of(a):
                product.meta["val"] = _aten.mm.default(a, b)
            total = graph.call_function(_aten.add.Tensor, (product, residual))
        total.meta.update(node.meta)
        node.replace_all_uses_with(total)
        graph.erase_node(node)

    def uuid(self) -> Optional[Any]:
        # Part of Inductor's cache key: a change of this file compiles anew.
        return (inductor.get_hash_for_files((__file__,)), self.devices)


@contextlib.contextmanager
def _fake_mode_of(t: torch.Tensor) -> Iterator[None]:
    mode = getattr(t, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def residual_adds_unfused(devices: Tuple[str, ...] = ("cuda",)) -> Iterator[None]:
    """Inductor compiles inside run :class:`UnfuseResidualAddmm`, unless the user set a post-grad pass."""
    if not inductor.AVAILABLE:  # nothing compiles with Inductor here: the compile raises, saying why
        yield
        return
    config = inductor.config
    if config.post_grad_custom_post_pass is not None:
        logger.debug("a post-grad pass is set already: residual adds may fold into addmm in the pieces")
        yield
        return
    with config.patch(post_grad_custom_post_pass=UnfuseResidualAddmm(devices)):
        yield
