"""One compiled graph for every token count, with Dynamo's backed symbols.

``mark_token_axis`` (``compiled_model.py``) marks the token axis *unbacked*:
no guard ever names the token count, but Inductor cannot reason about an
unbacked size, and it fuses less: each RMSNorm becomes a reduction kernel
plus a pointwise kernel. Backed, it is one kernel (on an H200 the 0.5b
whole-model decode graph went from 14 to 10 kernels per layer with this and
q and k rotated together, docs/BENCHMARKS.md).

``CompiledModel`` therefore marks the axis *backed* (``mark_dynamic``) and
traces it *size-obliviously* (``size_oblivious_tracing``): the trace does not
specialise on 0 or 1, and Inductor sees an ordinary symbol with a hint.
Dynamo's shape guards still bound that symbol from below (``s0 >= 2``,
``Ne(s0, 1)``: a trace is only trusted for the sizes it was traced at, and
a warm Inductor cache re-adds them), so a 1-token step would recompile.
``TokenShapeGuards`` drops those shape guards, and only those: when the
compile's shape guards all have one of the forms below, none of them
selects what the graph computes, so it serves every token count.

* a lower bound of at most 2 on a token-count symbol (``s >= 2``, ``s > 1``,
  ``Ne(s, 1)``, ``Ne(s, 0)``): the 0/1 specialisation that size-oblivious
  tracing made moot;
* an upper bound of at least ``MAX_TRACED_TOKENS`` (``896*s <= 2**31 - 1``,
  int32 indexing): ``CompiledModel`` never hands the graph more tokens;
* two token-count symbols equal (``Eq(s0, s1)``: ``input_ids`` and
  ``positions`` have the same length, as every caller's inputs do).

Any other guard on a shape (``s0 > 4`` or ``s0 <= 4`` from a Python branch
on the token count, a divisibility) keeps every shape guard, and so does a
trace whose token symbol was not created size-obliviously: such a step
recompiles, it never runs code traced for other sizes. The decision is
logged.

The size-oblivious setting and the shape environment are torch internals
(``internals/size_oblivious.py``); where this torch lacks them, the axis is
marked unbacked, as ``mark_token_axis`` does (nothing recompiles), and the
shape guards go unread and are kept (``kept_reason`` says so), so every
call goes through Dynamo. The guard entries (``guard_type``, ``name``,
``value``) are ``torch.compile``'s public ``guard_filter_fn`` interface.
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


# The most tokens one call of a compiled graph takes (CompiledModel runs a
# larger call without it). Each compile bounds the token count by it before
# Inductor runs: Inductor then proves that every buffer of up to 32768
# elements per token is indexable with int32, instead of guarding on it.
MAX_TRACED_TOKENS = 1 << 16


def mark_token_axis_backed(*tensors: torch.Tensor) -> None:
    """Dim 0 dynamic and backed (trace under ``size_oblivious_tracing``). A
    first call of 0 or 1 token marks it unbacked instead: Inductor reads a
    backed symbol's hint, the first call's size, and guards what it chose on
    it (``Eq(s0, 1)``), which would keep the trace to that size. So does a
    torch without size-oblivious tracing (``internals/size_oblivious.py``).
    """
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
    """``guard_filter_fn`` of one ``torch.compile``: drops the shape guards
    of a compile whose shape guards only bound the token count (module doc).

    The backend calls ``begin_compile`` with each compile's fake inputs
    before compiling; Dynamo calls the instance right after that compile
    with the guards it is about to install.
    """

    def __init__(self) -> None:
        self._shape_env: Any = None
        self._symbols: Set[sympy.Symbol] = set()
        self.dropped = 0  # compiles whose shape guards were dropped
        self.kept_reason: Optional[str] = None  # why the last compile kept them, if it did
        # The last compile's guards on constants ((source, value): a module's
        # eps, a head count): a saved compile is checked against them where
        # Dynamo no longer runs (precompiled.py).
        # None: this torch's guard entries carry no values.
        self.constants: Optional[List[Tuple[str, Any]]] = []

    def begin_compile(self, fake_mode: Any, fake_inputs: Sequence[Any]) -> None:
        """Bound the token counts by ``MAX_TRACED_TOKENS`` and remember the
        shape environment whose guards the filter will judge."""
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
            # The lower bounds are moot only if the trace did not specialise on 0
            # or 1: a backed symbol created outside size_oblivious_tracing (another
            # thread restored the setting mid-call, say) keeps them.
            specialising = size_oblivious.not_size_oblivious(shape_env, symbols)
            if specialising:
                return f"token count {specialising[0]} traced without size-oblivious tracing"
            # A symbol Dynamo replaced by a token symbol (positions' length by
            # input_ids') is one too: the inputs show only the replacement.
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
