"""Inductor's entry points for the piece compiler (``compile_fx``, saved
artifacts, the custom post-grad pass hook), written against torch 2.11-2.13.
They bypass nothing: they are how a backend hands a graph to Inductor.
Imported only by the Inductor paths. No fallback: a clear error.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, List, Sequence

import torch

from sgl_piecewise.errors import SglPiecewiseError

TORCH_VERSIONS = ("2.11", "2.13")  # written against; others are only checked for what is used

_NEEDED = (
    ("torch._inductor.compile_fx", "compile_fx"),
    ("torch._inductor", "standalone_compile"),
    ("torch._inductor", "CompiledArtifact"),
    ("torch._inductor", "config"),
    ("torch._inductor.custom_graph_pass", "CustomGraphPass"),
    ("torch._inductor.custom_graph_pass", "get_hash_for_files"),
)


def _find() -> Dict[str, Any]:
    found: Dict[str, Any] = {}
    for module, name in _NEEDED:
        try:
            found[name] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            pass
    return found


_found = _find()
_missing: List[str] = [f"{module}.{name}" for module, name in _NEEDED if name not in _found]
AVAILABLE: bool = not _missing
UNAVAILABLE_REASON: str = f"torch {torch.__version__} has no {', '.join(_missing)}" if _missing else ""

# Defined even where missing, so that modules subclassing them import.
CustomGraphPass: type = _found.get("CustomGraphPass", object)
config: Any = _found.get("config")


def require(what: str) -> None:
    if not AVAILABLE:
        raise SglPiecewiseError(
            f"{what}: expected Inductor's compile entry points, got {UNAVAILABLE_REASON}; use piece_compiler='eager'"
        )


def compile_fx(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    require("piece_compiler='inductor'")
    return _found["compile_fx"](gm, list(example_inputs))


def standalone_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """A saveable artifact of ``gm``; call inside a backend (sizes from the tracing context)."""
    require("a saved compile")
    return _found["standalone_compile"](gm, list(example_inputs), dynamic_shapes="from_tracing_context", aot=True)


def load_artifact(path: str) -> Any:
    require("loading a saved compile")
    return _found["CompiledArtifact"].load(path=path, format="binary")


def get_hash_for_files(paths: Sequence[str]) -> Any:
    require("a custom Inductor pass")
    return _found["get_hash_for_files"](tuple(paths))
