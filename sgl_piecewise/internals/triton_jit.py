"""Whether a ``@triton.jit`` kernel runs compiled or interpreted, by an
``isinstance`` check on the undocumented ``triton.runtime.jit.JITFunction``
(Triton 3.4-3.6). Fallback: ``TRITON_INTERPRET`` read as Triton reads it.
"""

from __future__ import annotations

import os
from typing import Any

TRITON_VERSIONS = ("3.4", "3.6")  # written against; others are only checked for what is used


def _find_jit_function() -> tuple:
    try:
        from triton.runtime.jit import JITFunction
    except ImportError as exc:
        return None, f"triton.runtime.jit.JITFunction does not import ({exc})"
    if not isinstance(JITFunction, type):
        return None, f"triton.runtime.jit.JITFunction is not a class ({type(JITFunction).__name__})"
    return JITFunction, ""


_JITFunction, UNAVAILABLE_REASON = _find_jit_function()
AVAILABLE: bool = _JITFunction is not None

# Triton's reading of a boolean environment variable (triton/knobs.py, env_bool).
_TRUE = ("1", "true", "yes", "on", "y")


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def runs_compiled(kernel: Any) -> bool:
    """Whether ``kernel`` (what ``triton.jit`` returned) compiles for the GPU."""
    if AVAILABLE:
        return isinstance(kernel, _JITFunction)
    return not interpreter_requested()
