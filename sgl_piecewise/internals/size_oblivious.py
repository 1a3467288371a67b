"""Size-oblivious tracing of a backed token axis (the private setting
``torch.fx.experimental._config.backed_size_oblivious``, set directly as it
wraps every call) and the ``ShapeEnv`` read that drops the guards only
bounding it (``compile/token_guards.py``); torch 2.11-2.13. Why: Inductor
fuses more on a backed axis, one graph for every token count. Fallback: the
axis unbacked, every guard kept, every call through Dynamo.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Set

import torch

TORCH_VERSIONS = ("2.11", "2.13")  # written against; others are only checked for what is used


def _check() -> str:
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
    """Within: Dynamo does not specialise backed sizes on 0 or 1."""

    __slots__ = ("_old",)

    def __enter__(self) -> None:
        self._old = None
        if AVAILABLE:
            self._old = _fx_config.backed_size_oblivious
            _fx_config.backed_size_oblivious = True

    def __exit__(self, *exc: Any) -> None:
        if self._old is not None:
            _fx_config.backed_size_oblivious = self._old


def expression(size: torch.SymInt) -> Any:
    return size.node.expr


def is_one_symbol(size: torch.SymInt) -> bool:
    """Is the size one symbol, not an expression (True where this torch cannot tell)?"""
    return not AVAILABLE or bool(size.node.expr.is_Symbol)


def shape_env(fake_mode: Any) -> Any:
    return fake_mode.shape_env


def not_size_oblivious(env: Any, symbols: Iterable[Any]) -> List[Any]:
    return [s for s in symbols if _symbol_is_type(s, _SymT.SIZE) and s not in env.size_like]


def replaced_by(env: Any, symbols: Set[Any]) -> Set[Any]:
    return {s for s, value in env.replacements.items() if value in symbols}


def shape_guards(env: Any) -> List[Any]:
    return [guard.expr for guard in env.guards]
