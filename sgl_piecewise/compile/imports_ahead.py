"""torch's compiler modules, imported before a start-up of graphs needs them.

A start-up of piecewise graphs imports Inductor's modules at its first size:
a cold start for its compiles, a warm start because the saved pieces' code
imports them (its header names ``torch._inductor.select_algorithm``, which
imports Inductor's lowerings), and both hash torch's sources for Inductor's
cache key (``torch_key``). On the H100 hosts measured (docs/BENCHMARKS.md)
that was 0.9-1.1 s of a 3 s warm start, all of it Python holding the GIL.

``models/loader.py`` calls :func:`import_compiler` on the main thread while
a worker thread reads or draws the model's weights, which is native work
that lets the GIL go, so the two overlap. Imports stay on the main thread:
two threads importing torch's modules at once can each find the other's
half-initialised module.
"""

from __future__ import annotations

import importlib
import logging
import sys

logger = logging.getLogger("sgl_piecewise")

# What Inductor's generated code imports in its header, and the entries a
# compile and a saved compile's load go through. select_algorithm is the
# costly one (0.6 s on the H100 hosts, 0.7 s on a CPU).
COMPILER_MODULES = (
    "torch._inductor.codecache",
    "torch._inductor.select_algorithm",
    "torch._inductor.codegen.memory_planning",
    "torch._inductor.async_compile",
    "torch._inductor.compile_fx",
    "torch._inductor.standalone_compile",
)


def compiler_imported() -> bool:
    """Has this process imported every module of :data:`COMPILER_MODULES`?"""
    return all(name in sys.modules for name in COMPILER_MODULES)


def import_compiler() -> None:
    """Import :data:`COMPILER_MODULES` and hash torch's sources for
    Inductor's cache key (cached for the process). A failure is only logged:
    the import or hash that needs it then raises where it is needed."""
    try:
        for name in COMPILER_MODULES:
            importlib.import_module(name)
        from torch._inductor.codecache import torch_key

        torch_key()
    except Exception as exc:  # a torch without these modules, or a broken one
        logger.debug("torch's compiler modules not imported ahead: %s: %s", type(exc).__name__, exc)
