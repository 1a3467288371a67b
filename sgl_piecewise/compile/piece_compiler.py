"""Compile one piece of a split graph: Inductor (default), eager or Torch-TensorRT.
``PieceCompiler`` keys every piece by its structure, so identical layers
compile once and share the artifact."""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.fx

from sgl_piecewise.errors import SglPiecewiseError
from sgl_piecewise.graphs.counters import counters
from sgl_piecewise.internals import dynamo_backend

logger = logging.getLogger("sgl_piecewise.compile")

CompiledPiece = Callable[..., Any]


def _target_name(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "get_attr":
        # A constant baked into the piece: identical only if it is the same object.
        return f"attr@{id(getattr(gm, node.target))}"
    target = node.target
    if callable(target):
        return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"
    return str(target)


def _input_signature(args: Sequence[Any]) -> str:
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(f"T{tuple(a.shape)}{tuple(a.stride())}{a.dtype}{a.device}{a.requires_grad}")
        else:
            parts.append(f"{type(a).__name__}:{a}")
    return ";".join(parts)


def structural_key(gm: torch.fx.GraphModule, args: Sequence[Any]) -> str:
    """Equal for two pieces iff they compute the same function of their inputs."""
    index: Dict[torch.fx.Node, int] = {}
    lines = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        rename = lambda n: f"%{index[n]}"  # noqa: E731
        args_s = torch.fx.node.map_arg(node.args, rename)
        kwargs_s = torch.fx.node.map_arg(node.kwargs, rename)
        lines.append(f"{node.op}|{_target_name(node, gm)}|{args_s}|{kwargs_s}")
    lines.append(_input_signature(args))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


class PieceCompiler:
    """Compiles pieces with one backend and shares artifacts between equal ones."""

    def __init__(self, compiler: str, share_identical: bool = True, keep_artifacts: bool = False):
        self.compiler = compiler
        self.share_identical = share_identical
        self._cache: Dict[str, CompiledPiece] = {}
        # Inductor pieces as saveable artifacts (precompiled.py), in compile order.
        self.keep_artifacts = keep_artifacts and compiler == "inductor"
        self.artifacts: List[Any] = []

    def key(self, gm: torch.fx.GraphModule, fake_args: Sequence[Any]) -> Optional[str]:
        """The piece's structural key, or None when pieces are not shared."""
        return structural_key(gm, fake_args) if self.share_identical else None

    def __call__(self, gm: torch.fx.GraphModule, fake_args: Sequence[Any], key: Optional[str] = None) -> CompiledPiece:
        counters.pieces_seen += 1
        key = key if key is not None else self.key(gm, fake_args)
        if key is not None and key in self._cache:
            return self._cache[key]
        if self.keep_artifacts:
            compiled = _compile_inductor_artifact(gm, list(fake_args))
            self.artifacts.append(compiled)
        else:
            compiled = _COMPILERS[self.compiler](gm, list(fake_args))
        counters.pieces_compiled += 1
        if key is not None:
            self._cache[key] = compiled
        return compiled


def _compile_eager(gm: torch.fx.GraphModule, fake_args: list) -> CompiledPiece:
    return gm


def _compile_inductor(gm: torch.fx.GraphModule, fake_args: list) -> CompiledPiece:
    from sgl_piecewise.compile.residual_add import residual_adds_unfused  # imports Inductor
    from sgl_piecewise.internals import inductor

    with residual_adds_unfused():
        return inductor.compile_fx(gm, fake_args)


def _compile_inductor_artifact(gm: torch.fx.GraphModule, fake_args: list) -> CompiledPiece:
    """Inductor's compile as an artifact a later process loads without compiling."""
    from sgl_piecewise.compile.residual_add import residual_adds_unfused  # imports Inductor
    from sgl_piecewise.internals import inductor

    with residual_adds_unfused():
        return inductor.standalone_compile(gm, fake_args)


def _compile_tensorrt(gm: torch.fx.GraphModule, fake_args: list) -> CompiledPiece:
    try:
        import torch_tensorrt  # noqa: F401  (registers the "tensorrt" Dynamo backend)
    except ImportError as e:
        raise SglPiecewiseError(
            "piece_compiler='tensorrt': expected torch-tensorrt to be installed, got "
            f"ImportError ({e}); do `pip install sgl_piecewise[tensorrt]`"
        ) from e
    return dynamo_backend.lookup_backend("tensorrt")(gm, fake_args)


_COMPILERS: Dict[str, Callable[[torch.fx.GraphModule, list], CompiledPiece]] = {
    "eager": _compile_eager,
    "inductor": _compile_inductor,
    "tensorrt": _compile_tensorrt,
}
