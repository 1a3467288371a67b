"""One compiled graph for every token count, with Dynamo's backed symbols.

An unbacked token axis (``mark_token_axis``) fuses less in Inductor, so
``CompiledModel`` marks it backed and traces size-obliviously. Dynamo's shape
guards still bound the symbol (``s0 >= 2``), so ``TokenShapeGuards`` drops a
compile's shape guards when each is a lower bound of at most 2, an upper
bound of at least ``MAX_TRACED_TOKENS`` or an equality of two token counts.
Any other (a branch on the token count) keeps them all: such a step
recompiles rather than run code traced for other sizes. Without the torch
internals this needs (``internals/size_oblivious.py``), the axis is marked
unbacked and the guards are kept.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Sequence, Set, Tuple

import sympy
import torch

from sgl_piecewise.internals import size_oblivious
from sgl_piecewise.internals.size_oblivious import size_oblivious_tracing

__all__ = ["MAX_TRACED_TOKENS", "TokenShapeGuards", "mark_token_axis_backed", "size_oblivious_tracing"]

logger = logging.getLogger("sgl_piecewise.compile")

_SHAPE_GUARD = "SHAPE_ENV"
_CONSTANT_GUARDS = ("CONSTANT_MATCH", "EQUALS_MATCH")


# The most tokens one call of a compiled graph takes: with this bound Inductor
# proves int32 indexing instead of guarding on it.
MAX_TRACED_TOKENS = 1 << 16


def mark_token_axis_backed(*tensors: torch.Tensor) -> None:
    """Dim 0 dynamic and backed; unbacked for a first call of 0 or 1 token (Inductor
    would guard on that hint) or without size-oblivious tracing."""
    backed = size_oblivious.AVAILABLE
    for t in tensors:
        if t.shape[0] < 2 or not backed:
            torch._dynamo.decorators.mark_unbacked(t, 0)
        else:
            torch._dynamo.mark_dynamic(t, 0)


def _constant_guards(entries: Sequence[Any]) -> Optional[List[Tuple[str, Any]]]:
    try:
        return [(e.name, e.value) for e in entries if e.guard_type in _CONSTANT_GUARDS and e.has_value]
    except AttributeError:
        return None


class TokenShapeGuards:
    """``guard_filter_fn`` of one ``torch.compile`` (module docstring); the backend
    calls ``begin_compile`` before each compile, Dynamo the instance after it."""

    def __init__(self) -> None:
        self._shape_env: Any = None
        self._symbols: Set[sympy.Symbol] = set()
        self.dropped = 0  # compiles whose shape guards were dropped
        self.kept_reason: Optional[str] = None  # why the last compile kept them, if it did
        # The last compile's constant guards, (source, value); None: this torch gives no values.
        self.constants: Optional[List[Tuple[str, Any]]] = []

    def begin_compile(self, fake_mode: Any, fake_inputs: Sequence[Any]) -> None:
        """Bound the token counts and remember the shape environment to judge."""
        sizes = _token_sizes(fake_inputs)
        for size in sizes:
            torch._check(size <= MAX_TRACED_TOKENS)
        if size_oblivious.AVAILABLE:
            self._shape_env = size_oblivious.shape_env(fake_mode)
            self._symbols = {size_oblivious.expression(size) for size in sizes}

    def __call__(self, entries: Sequence[Any]) -> list:
        shape_env, symbols = self._shape_env, self._symbols
        self._shape_env, self._symbols = None, set()  # one compile's record serves one filter call
        self.constants = _constant_guards(entries)
        if not any(e.guard_type == _SHAPE_GUARD for e in entries):
            return [True] * len(entries)
        reason = self._why_keep(shape_env, symbols)
        self.kept_reason = reason
        if reason is not None:
            logger.info("shape guards kept (a token count may recompile): %s", reason)
            return [True] * len(entries)
        self.dropped += 1
        return [e.guard_type != _SHAPE_GUARD for e in entries]

    @staticmethod
    def _why_keep(shape_env: Any, symbols: Set[sympy.Symbol]) -> Optional[str]:
        if not size_oblivious.AVAILABLE:
            return f"shape guards not read: {size_oblivious.UNAVAILABLE_REASON}"
        if shape_env is None or not symbols:
            return "no token-count symbol recorded for this compile"
        try:
            # The lower bounds are moot only if the trace did not specialise on 0 or 1.
            specialising = size_oblivious.not_size_oblivious(shape_env, symbols)
            if specialising:
                return f"token count {specialising[0]} traced without size-oblivious tracing"
            # A symbol Dynamo replaced by a token symbol is one too.
            symbols = symbols | size_oblivious.replaced_by(shape_env, symbols)
            guards = size_oblivious.shape_guards(shape_env)
        except AttributeError as exc:  # a torch whose shape environment changed since
            return f"shape guards not read: {exc}"
        for expr in guards:
            if not _only_bounds_token_count(expr, symbols):
                return f"guard {expr} selects what the graph computes"
        return None


def _only_bounds_token_count(expr: Any, symbols: Set[sympy.Symbol]) -> bool:
    """``expr`` bounds one token symbol from below by at most 2 or from above
    by at least ``MAX_TRACED_TOKENS``, or equates two token symbols."""
    if expr is sympy.true:
        return True
    if isinstance(expr, sympy.Eq):
        return expr.lhs in symbols and expr.rhs in symbols
    if isinstance(expr, sympy.Ne):
        return _symbol_and_int(expr.lhs, expr.rhs, symbols) in (0, 1)
    if isinstance(expr, (sympy.GreaterThan, sympy.StrictGreaterThan)):
        positive = expr.lhs - expr.rhs  # the guard says: positive >= 0 (> 0 if strict)
    elif isinstance(expr, (sympy.LessThan, sympy.StrictLessThan)):
        positive = expr.rhs - expr.lhs
    else:
        return False
    strict = isinstance(expr, (sympy.StrictGreaterThan, sympy.StrictLessThan))
    linear = _linear_in_one(positive, symbols)
    if linear is None:
        return False
    a, b = linear  # a * s + b >= 0 (> 0 if strict), a != 0
    edge = sympy.Rational(-b, 1) / a
    if a > 0:  # s >= edge: a lower bound
        lowest = sympy.floor(edge) + 1 if strict else sympy.ceiling(edge)
        return lowest <= 2
    highest = sympy.ceiling(edge) - 1 if strict else sympy.floor(edge)  # s <= edge: an upper bound
    return highest >= MAX_TRACED_TOKENS


def _linear_in_one(expr: Any, symbols: Set[sympy.Symbol]) -> Optional[tuple]:
    """``(a, b)`` with ``expr == a * s + b`` for one token symbol ``s`` and
    rational ``a != 0``, ``b``; None for anything else."""
    free = expr.free_symbols
    if len(free) != 1 or not free <= symbols:
        return None
    (s,) = free
    try:
        poly = sympy.Poly(expr, s)
    except sympy.PolynomialError:
        return None
    coeffs = poly.all_coeffs()
    if poly.degree() != 1 or not all(isinstance(c, sympy.Rational) for c in coeffs):
        return None
    return coeffs[0], coeffs[1]


def _symbol_and_int(a: Any, b: Any, symbols: Set[sympy.Symbol]) -> Optional[int]:
    """The integer of ``{symbol, integer}`` in either order, else None."""
    if a in symbols and isinstance(b, sympy.Integer):
        return int(b)
    if b in symbols and isinstance(a, sympy.Integer):
        return int(a)
    return None


def _token_sizes(fake_inputs: Sequence[Any]) -> list:
    """The symbolic dim-0 sizes of the fake inputs (weights are static)."""
    sizes = []
    for x in fake_inputs:
        if isinstance(x, torch.Tensor) and x.dim():
            size = x.shape[0]
            if isinstance(size, torch.SymInt) and size_oblivious.is_one_symbol(size):
                sizes.append(size)
    return sizes
