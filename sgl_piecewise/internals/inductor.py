"""Inductor's entry points, as the piece compiler calls them.

* :func:`compile_fx` (``torch._inductor.compile_fx.compile_fx``): compiles
  one piece; the entry ``backend="inductor"`` itself uses, so a piece
  compiles as ``torch.compile`` would compile it.
* :func:`standalone_compile` and :func:`load_artifact`
  (``torch._inductor.standalone_compile``, ``torch._inductor.CompiledArtifact``):
  a piece compiled as an artifact a later process loads without compiling,
  for the saved compile (``compile/precompiled.py``: warm start 9-11 s ->
  2-4 s for the 0.5B shape, docs/BENCHMARKS.md).
* :data:`CustomGraphPass`, :func:`get_hash_for_files` and :data:`config`
  (``torch._inductor.custom_graph_pass``, ``torch._inductor.config``):
  Inductor's hook for a post-grad pass of one's own, for
  ``compile/residual_add.py``.

These bypass nothing: they are how a backend hands a graph to Inductor,
with no public equivalent in torch 2.11-2.13 (written against those).
Importing Inductor takes seconds, so only the Inductor paths import this
module (``piece_compiler='eager'`` never does). :data:`AVAILABLE` says at
import whether everything above is there; there is no fallback: the calls
raise ``SglPiecewiseError`` naming what is missing (``piece_compiler='eager'``
needs none of it).
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

# Defined even where missing, so modules that subclass or patch them import;
# they are only used after require().
CustomGraphPass: type = _found.get("CustomGraphPass", object)
config: Any = _found.get("config")


def require(what: str) -> None:
    """Raise, naming ``what`` needed it, unless this torch has all of the above."""
    if not AVAILABLE:
        raise SglPiecewiseError(
            f"{what}: expected Inductor's compile entry points, got {UNAVAILABLE_REASON}; use piece_compiler='eager'"
        )


def compile_fx(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """Inductor's compile of ``gm`` for ``example_inputs`` (fake, with their symbolic sizes)."""
    require("piece_compiler='inductor'")
    return _found["compile_fx"](gm, list(example_inputs))


def standalone_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """Inductor's compile of ``gm`` as a saveable artifact (``aot=True``: the
    whole AOTAutograd and Inductor output in one file); call inside a
    backend: the symbolic sizes come from the ambient tracing context."""
    require("a saved compile")
    return _found["standalone_compile"](gm, list(example_inputs), dynamic_shapes="from_tracing_context", aot=True)


def load_artifact(path: str) -> Any:
    """An artifact ``standalone_compile`` made and saved (``format="binary"``)."""
    require("loading a saved compile")
    return _found["CompiledArtifact"].load(path=path, format="binary")


def get_hash_for_files(paths: Sequence[str]) -> Any:
    """Inductor's hash of the files' contents, for a custom pass's ``uuid``."""
    require("a custom Inductor pass")
    return _found["get_hash_for_files"](tuple(paths))
