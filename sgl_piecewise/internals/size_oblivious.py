"""Dynamo's size-oblivious tracing of a backed size, and the reading of a
compile's shape environment that tells whether its shape guards only bound
the token count. The policy (which guards may go) is
``compile/token_guards.py``'s; this module holds what it reads.

What it bypasses:

* ``torch.fx.experimental._config.backed_size_oblivious``, a private
  setting: while it is on, Dynamo does not specialise a backed size on 0 or
  1. :class:`size_oblivious_tracing` sets and restores it directly (about
  2 µs; ``config.patch`` takes about 20), because it wraps every compiled
  call: any call may be the one that traces;
* symbolic-shape internals: whether a symbol is a backed size
  (``SymT.SIZE``, ``symbol_is_type``) and was created size-obliviously
  (``ShapeEnv.size_like``), which symbols Dynamo replaced by which
  (``ShapeEnv.replacements``), the shape guards as sympy expressions
  (``ShapeEnv.guards``), a fake mode's shape environment and a ``SymInt``'s
  expression (``SymInt.node.expr``).

Why: a backed token axis lets Inductor reason about the size, and it fuses
more: each RMSNorm is one kernel instead of a reduction plus a pointwise
kernel (on an H200 the 0.5B whole-model decode step went from 14 to 10
kernels per layer with this and q and k rotated together,
docs/BENCHMARKS.md). Size-oblivious tracing and dropping the guards that
only bound the token count from below keep one graph for every token count,
1 included (no recompile at the first 1-token step).

Written against torch 2.11-2.13. :data:`AVAILABLE` says at import whether
the setting, ``SymT.SIZE``, ``symbol_is_type`` and the shape environment's
attributes are there (the last by the names ``ShapeEnv`` sets in its
constructor: building one to look would take seconds). It is read at every
call, so a test sets it False to force the fallback, which is the public
one: the token axis marked unbacked (``torch._dynamo.decorators.mark_unbacked``,
as a first call of 0 or 1 token already is), and
:class:`size_oblivious_tracing` does nothing. Dynamo specialises an
unbacked size on nothing, so no token count recompiles; its shape guards
(the two token inputs of equal length, at most ``MAX_TRACED_TOKENS``) go
unread and are all kept, so every call goes through Dynamo, which checks
them: no call without Dynamo after the first compile and no saved compile
(``compile/precompiled.py``). Inductor fuses less (the RMSNorms above in two
kernels each); the outputs are the same.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Set

import torch

TORCH_VERSIONS = ("2.11", "2.13")  # written against; others are only checked for what is used


def _check() -> str:
    """Why this torch lacks what the module uses ('' when it has it all)."""
    try:
        import torch.fx.experimental._config as fx_config
        from torch.fx.experimental.symbolic_shapes import ShapeEnv, SymT, symbol_is_type
    except ImportError as exc:
        return f"symbolic shapes do not import ({exc})"
    if not isinstance(getattr(fx_config, "backed_size_oblivious", None), bool):
        return "torch.fx.experimental._config has no backed_size_oblivious setting"
    if not hasattr(SymT, "SIZE") or not callable(symbol_is_type):
        return "torch.fx.experimental.symbolic_shapes has no SymT.SIZE or symbol_is_type"
    names: Set[str] = set()
    for init in (ShapeEnv.__init__, getattr(ShapeEnv, "_init", None)):
        names |= set(getattr(getattr(init, "__code__", None), "co_names", ()))
    missing = {"size_like", "replacements", "guards"} - names
    if missing:
        return f"ShapeEnv sets no {', '.join(sorted(missing))}"
    return ""


UNAVAILABLE_REASON: str = _check()
AVAILABLE: bool = not UNAVAILABLE_REASON
if AVAILABLE:
    import torch.fx.experimental._config as _fx_config
    from torch.fx.experimental.symbolic_shapes import SymT as _SymT
    from torch.fx.experimental.symbolic_shapes import symbol_is_type as _symbol_is_type
else:
    UNAVAILABLE_REASON = f"torch {torch.__version__}: {UNAVAILABLE_REASON}"


class size_oblivious_tracing:
    """Within: Dynamo does not specialise backed sizes on 0 or 1 (nothing
    where this torch cannot; the token axis is then unbacked)."""

    __slots__ = ("_old",)

    def __enter__(self) -> None:
        self._old = None  # None: nothing set
        if AVAILABLE:
            self._old = _fx_config.backed_size_oblivious
            _fx_config.backed_size_oblivious = True

    def __exit__(self, *exc: Any) -> None:
        if self._old is not None:
            _fx_config.backed_size_oblivious = self._old


def expression(size: torch.SymInt) -> Any:
    """The sympy expression of a symbolic size."""
    return size.node.expr


def is_one_symbol(size: torch.SymInt) -> bool:
    """Is the symbolic size one symbol (an input's own size, not an
    expression of others)? Where this torch cannot tell, True."""
    return not AVAILABLE or bool(size.node.expr.is_Symbol)


def shape_env(fake_mode: Any) -> Any:
    """The shape environment of a compile's fake mode."""
    return fake_mode.shape_env


def not_size_oblivious(env: Any, symbols: Iterable[Any]) -> List[Any]:
    """The backed size symbols among ``symbols`` that were created outside
    size-oblivious tracing (so the trace may have specialised on 0 or 1)."""
    return [s for s in symbols if _symbol_is_type(s, _SymT.SIZE) and s not in env.size_like]


def replaced_by(env: Any, symbols: Set[Any]) -> Set[Any]:
    """The symbols Dynamo replaced by one of ``symbols`` (a tensor's length
    found equal to another's)."""
    return {s for s, value in env.replacements.items() if value in symbols}


def shape_guards(env: Any) -> List[Any]:
    """The compile's shape guards, as sympy expressions."""
    return [guard.expr for guard in env.guards]
