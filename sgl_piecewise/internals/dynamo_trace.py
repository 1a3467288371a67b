"""What Dynamo's trace tells beyond the graph (written against torch
2.11-2.13): the code it inlined (``TracingContext.get_traced_code``) and its
side effects (the ``InstructionTranslator``'s ``side_effects``). Why: a
graph is called without Dynamo, or saved whole, only where both are known.
Fallback: :class:`TraceUnreadable`; every call goes through Dynamo.
"""

from __future__ import annotations

import importlib
from typing import Any, List

import torch

TORCH_VERSIONS = ("2.11", "2.13")  # written against; others are only checked for what is used


class TraceUnreadable(Exception):
    """:data:`AVAILABLE` is False."""


def _sets(cls: type, attribute: str) -> bool:
    return attribute in getattr(getattr(cls.__init__, "__code__", None), "co_names", ())


def _check() -> str:
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
    _require()
    return list(_TracingContext.get_traced_code() or ())


def mutated_existing_objects() -> int:
    """How many objects that existed before the traced call the trace mutated."""
    _require()
    effects = _InstructionTranslator.current_tx().output.side_effects
    new = (_AttributeMutationNew, _ValueMutationNew)
    existing = [v for v in effects.id_to_variable.values() if not isinstance(v.mutation_type, new)]
    return sum(1 for v in existing if effects.is_modified(v))
