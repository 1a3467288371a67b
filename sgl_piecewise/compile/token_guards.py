"""One compiled graph for every token count, with Dynamo's backed symbols.

``mark_token_axis`` (``compiled_model.py``) marks the token axis *unbacked*:
no guard ever names the token count, but Inductor cannot reason about an
unbacked size, and it fuses less. Measured on an H200 (0.5b shape, one
whole-model decode graph): the RMSNorm splits into a reduction kernel and a
pointwise kernel, and the model launches 14 kernels per layer instead of 11.

``CompiledModel`` therefore marks the axis *backed* (``mark_dynamic``) and
traces it *size-obliviously* (``backed_size_oblivious``): the trace does not
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
* two token-count symbols equal (``Eq(s0, s1)``: ``input_ids`` and
  ``positions`` have the same length, as every caller's inputs do).

Any other guard on a shape (``s0 > 4`` from a Python branch on the token
count, a divisibility, an upper bound) keeps every shape guard: such a step
recompiles, it never runs code traced for other sizes. The decision is
logged.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence, Set

import sympy
import torch
import torch.fx.experimental._config as fx_config

logger = logging.getLogger("sgl_piecewise.compile")

_SHAPE_GUARD = "SHAPE_ENV"


def mark_token_axis_backed(*tensors: torch.Tensor) -> None:
    """Dim 0 dynamic and backed (trace under ``size_oblivious_tracing``).

    The symbol's hint, which Inductor's choices read, is the token count,
    but at least 2: Inductor evaluates some choices on the hint and guards
    them, and a hint of 1 would give ``Eq(s0, 1)``, a guard that keeps the
    trace to 1 token.
    """
    for t in tensors:
        hint = t.shape[0] if t.shape[0] >= 2 else 2
        torch._dynamo.mark_dynamic(t, 0, hint_override=hint)


class size_oblivious_tracing:
    """Within: Dynamo does not specialise backed sizes on 0 or 1.

    Set and restored directly (about 2 µs) rather than through
    ``config.patch`` (about 20 µs): it wraps every compiled call, because
    any call may be the one that traces.
    """

    __slots__ = ("_old",)

    def __enter__(self) -> None:
        self._old = fx_config.backed_size_oblivious
        fx_config.backed_size_oblivious = True

    def __exit__(self, *exc: Any) -> None:
        fx_config.backed_size_oblivious = self._old


class TokenShapeGuards:
    """``guard_filter_fn`` of one ``torch.compile``: drops the shape guards
    of a compile whose shape guards only bound the token count (module doc).

    The backend calls ``record`` with each compile's shape environment and
    token-count symbols; Dynamo calls the instance right after that compile
    with the guards it is about to install.
    """

    def __init__(self) -> None:
        self._shape_env: Any = None
        self._symbols: Set[sympy.Symbol] = set()
        self.dropped = 0  # compiles whose shape guards were dropped
        self.kept_reason: Optional[str] = None  # why the last compile kept them, if it did

    def record(self, shape_env: Any, token_symbols: Set[sympy.Symbol]) -> None:
        self._shape_env, self._symbols = shape_env, set(token_symbols)

    def __call__(self, entries: Sequence[Any]) -> list:
        shape_env, symbols = self._shape_env, self._symbols
        self._shape_env, self._symbols = None, set()  # one compile's record serves one filter call
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
        if shape_env is None or not symbols:
            return "no token-count symbol recorded for this compile"
        # A symbol Dynamo replaced by a token symbol (positions' length by
        # input_ids') is one too: the inputs show only the replacement.
        symbols = symbols | {s for s, value in shape_env.replacements.items() if value in symbols}
        for guard in shape_env.guards:
            if not _only_bounds_token_count(guard.expr, symbols):
                return f"guard {guard.expr} selects what the graph computes"
        return None


def _only_bounds_token_count(expr: Any, symbols: Set[sympy.Symbol]) -> bool:
    """``expr`` is a lower bound of at most 2 on a token symbol, or two token symbols equal."""
    if expr is sympy.true:
        return True
    if not isinstance(expr, sympy.core.relational.Relational):
        return False
    lhs, rhs = expr.lhs, expr.rhs
    if isinstance(expr, sympy.Eq):
        return lhs in symbols and rhs in symbols
    if isinstance(expr, sympy.Ne):
        return _symbol_and_int(lhs, rhs, symbols) in (0, 1)
    # Normalise to ``symbol >= bound`` or ``symbol > bound``.
    if isinstance(expr, (sympy.GreaterThan, sympy.StrictGreaterThan)):
        bound = _int_if_symbol(lhs, rhs, symbols)
    elif isinstance(expr, (sympy.LessThan, sympy.StrictLessThan)):
        bound = _int_if_symbol(rhs, lhs, symbols)
    else:
        return False
    if bound is None:
        return False
    strict = isinstance(expr, (sympy.StrictGreaterThan, sympy.StrictLessThan))
    return bound + (1 if strict else 0) <= 2


def _symbol_and_int(a: Any, b: Any, symbols: Set[sympy.Symbol]) -> Optional[int]:
    """The integer of ``{symbol, integer}`` in either order, else None."""
    if a in symbols and isinstance(b, sympy.Integer):
        return int(b)
    if b in symbols and isinstance(a, sympy.Integer):
        return int(a)
    return None


def _int_if_symbol(symbol: Any, bound: Any, symbols: Set[sympy.Symbol]) -> Optional[int]:
    return int(bound) if symbol in symbols and isinstance(bound, sympy.Integer) else None


def token_symbols(fake_inputs: Sequence[Any]) -> Set[sympy.Symbol]:
    """The symbols of the fake inputs' dim 0, weights excluded."""
    found = set()
    for x in fake_inputs:
        if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter) and x.dim():
            size = x.shape[0]
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                found.add(size.node.expr)
    return found
