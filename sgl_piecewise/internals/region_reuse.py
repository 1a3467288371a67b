"""Dynamo's reuse of a traced ``nested_compile_region`` (for ``regions.py``):
the private ``torch._dynamo.variables.invoke_subgraph`` and the config flag
``inline_invoke_subgraph``, which inlines the regions back into one flat
graph. Why: a model's layers are traced once, not once each. Written against
torch 2.11-2.13 (2.11 lacks the reuse). Fallback: regions run as written.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Iterator

import torch

TORCH_VERSIONS = ("2.11", "2.13")  # written against; others are only checked for what is used


def _check() -> str:
    try:
        spec = importlib.util.find_spec("torch._dynamo.variables.invoke_subgraph")
    except ImportError:
        spec = None
    if spec is None:
        return "no torch._dynamo.variables.invoke_subgraph"
    if not hasattr(torch._dynamo.config, "inline_invoke_subgraph"):
        return "no torch._dynamo.config.inline_invoke_subgraph"
    return ""


UNAVAILABLE_REASON: str = _check()
AVAILABLE: bool = not UNAVAILABLE_REASON
if not AVAILABLE:
    UNAVAILABLE_REASON = f"torch {torch.__version__}: {UNAVAILABLE_REASON}"


@contextlib.contextmanager
def inlined_regions() -> Iterator[None]:
    with torch._dynamo.config.patch(inline_invoke_subgraph=True):
        yield
