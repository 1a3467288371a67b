"""Whether a ``@triton.jit`` kernel runs compiled or under Triton's interpreter.

``triton.jit`` returns a ``JITFunction``, compiled for the GPU at its first
launch, unless Triton's interpreter is on (``TRITON_INTERPRET=1`` when the
kernel is decorated): then an object that runs the kernel with numpy on CPU
tensors. Callers adapt to it: the interpreter's bfloat16 dot needs its
operands upcast (the kernels' ``UPCAST``), it has no libdevice
(``ops/kernels/elementwise.py``), it launches nothing through the fast launcher
(``triton_launch.py``), and the triton backend over CPU pools needs it.

Private API: the class ``triton.runtime.jit.JITFunction`` (Triton re-exports
it as ``triton.JITFunction`` but documents neither), used for an
``isinstance`` check only. Written against Triton 3.4-3.6 (the GPU hosts run
3.6; also checked on 3.9). :data:`AVAILABLE` says at import whether the
class is there; where it is not, :func:`runs_compiled` falls back to the
public switch: ``TRITON_INTERPRET`` read as Triton reads it. That answers as
``triton.jit`` did unless a program turned the interpreter on through
``triton.knobs`` instead of the environment.
"""

from __future__ import annotations

import os
from typing import Any

# Written against these; a version outside them is not refused, only
# checked for what this module uses (AVAILABLE).
TRITON_VERSIONS = ("3.4", "3.6")


def _find_jit_function() -> tuple:
    """(the JITFunction class or None, why not: '' when found)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError as exc:
        return None, f"triton.runtime.jit.JITFunction does not import ({exc})"
    if not isinstance(JITFunction, type):
        return None, f"triton.runtime.jit.JITFunction is not a class ({type(JITFunction).__name__})"
    return JITFunction, ""


_JITFunction, UNAVAILABLE_REASON = _find_jit_function()
# Whether runs_compiled() asks the kernel's class (True) or the environment.
AVAILABLE: bool = _JITFunction is not None

# Triton's reading of a boolean environment variable (triton/knobs.py, env_bool).
_TRUE = ("1", "true", "yes", "on", "y")


def interpreter_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's interpreter, as Triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def runs_compiled(kernel: Any) -> bool:
    """Whether ``kernel`` (what ``triton.jit`` returned) compiles for the GPU,
    rather than running under Triton's interpreter."""
    if AVAILABLE:
        return isinstance(kernel, _JITFunction)
    return not interpreter_requested()
