"""What Dynamo's trace of the graph being compiled tells beyond the graph:
the source files it read and whether it had side effects. Read inside the
backend, while Dynamo is compiling.

What it bypasses: Dynamo keeps both in its tracing state and exposes
neither publicly.

* :func:`traced_code`: ``torch._guards.TracingContext.get_traced_code()``,
  the code objects the trace inlined. A saved compile
  (``compile/precompiled.py``) stores a hash of each of their files and is
  stale once one changed.
* :func:`mutated_existing_objects`: the instruction translator of the
  running trace (``torch._dynamo.symbolic_convert.InstructionTranslator.current_tx()``),
  its ``output.side_effects`` (``id_to_variable``, ``is_modified``) and
  the mutation kinds of objects the trace created itself
  (``torch._dynamo.variables.base.AttributeMutationNew``,
  ``ValueMutationNew``): how many objects that existed before the call the
  trace mutated (an attribute set in ``forward``, a global, a cell). A
  graph with such effects is not the whole call, and may not be called
  without Dynamo.

Why: both gate the calls without Dynamo. A ``CompiledModel`` calls its
graph directly after its first compile (Dynamo's per-call guards skipped)
only where the trace had no side effects, and with
``CompileOptions(cache_dir=...)`` saves the compile whole only where it
also knows the traced files: a later process then starts without Dynamo or
Inductor (warm start 9-11 s -> 2-4 s for the 0.5B shape,
docs/BENCHMARKS.md).

Written against torch 2.11-2.13. :data:`AVAILABLE` says at import whether
the calls and classes are there (the instance attributes by the names the
constructors set). It is read at every call, so a test sets it False to
force the fallback: both functions raise :class:`TraceUnreadable`, and the
callers treat that as "unknown": nothing is saved, and every call goes
through Dynamo as ``torch.compile`` does, with the reason logged. Outputs
are the same; the start is a cold one, and each call pays Dynamo's guards.
"""

from __future__ import annotations

import importlib
from typing import Any, List

import torch

TORCH_VERSIONS = ("2.11", "2.13")  # written against; others are only checked for what is used


class TraceUnreadable(Exception):
    """This torch's trace state cannot be read (:data:`AVAILABLE` False)."""


def _sets(cls: type, attribute: str) -> bool:
    """Does ``cls``'s constructor set ``attribute`` (by the names its code uses)?"""
    return attribute in getattr(getattr(cls.__init__, "__code__", None), "co_names", ())


def _check() -> str:
    """Why this torch lacks what the module uses ('' when it has it all)."""
    needed = (
        ("torch._guards", "TracingContext"),
        ("torch._dynamo.symbolic_convert", "InstructionTranslator"),
        ("torch._dynamo.variables.base", "AttributeMutationNew"),
        ("torch._dynamo.variables.base", "ValueMutationNew"),
        ("torch._dynamo.variables.base", "VariableTracker"),
        ("torch._dynamo.side_effects", "SideEffects"),
        ("torch._dynamo.output_graph", "OutputGraph"),
    )
    found = {}
    for module, name in needed:
        try:
            found[name] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return f"no {module}.{name}"
    checks = (
        (callable(getattr(found["TracingContext"], "get_traced_code", None)), "TracingContext.get_traced_code"),
        (callable(getattr(found["InstructionTranslator"], "current_tx", None)), "InstructionTranslator.current_tx"),
        (callable(getattr(found["SideEffects"], "is_modified", None)), "SideEffects.is_modified"),
        (_sets(found["SideEffects"], "id_to_variable"), "SideEffects.id_to_variable"),
        (_sets(found["OutputGraph"], "side_effects"), "OutputGraph.side_effects"),
        (_sets(found["VariableTracker"], "mutation_type"), "VariableTracker.mutation_type"),
    )
    missing = [what for present, what in checks if not present]
    return f"no {', '.join(missing)}" if missing else ""


UNAVAILABLE_REASON: str = _check()
AVAILABLE: bool = not UNAVAILABLE_REASON
if AVAILABLE:
    from torch._dynamo.symbolic_convert import InstructionTranslator as _InstructionTranslator
    from torch._dynamo.variables.base import AttributeMutationNew as _AttributeMutationNew
    from torch._dynamo.variables.base import ValueMutationNew as _ValueMutationNew
    from torch._guards import TracingContext as _TracingContext
else:
    UNAVAILABLE_REASON = f"torch {torch.__version__}: {UNAVAILABLE_REASON}"


def _require() -> None:
    if not AVAILABLE:
        raise TraceUnreadable(UNAVAILABLE_REASON)


def traced_code() -> List[Any]:
    """The code objects Dynamo traced for the graph being compiled."""
    _require()
    return list(_TracingContext.get_traced_code() or ())


def mutated_existing_objects() -> int:
    """How many objects that existed before the traced call the trace
    mutated (attributes, globals, cells). Objects the trace created itself
    reach the caller only through the result or through an existing object,
    whose mutation counts here."""
    _require()
    effects = _InstructionTranslator.current_tx().output.side_effects
    new = (_AttributeMutationNew, _ValueMutationNew)
    existing = [v for v in effects.id_to_variable.values() if not isinstance(v.mutation_type, new)]
    return sum(1 for v in existing if effects.is_modified(v))
