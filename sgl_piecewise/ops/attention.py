"""``sgl_piecewise::unified_attention`` and its out variant: write the new
tokens' K/V (``q [T, Hq, D]``, ``k, v [T, Hkv, D|Dv]``) into the paged pool
and attend with the active forward context's backend, giving ``[T, Hq, Dv]``.
Rows past the batch's ``num_tokens`` (graph padding) write no K/V and get
zeros.

Both ops are opaque to Dynamo, so the compile backend splits the graph around
them. ``layer_id`` and ``scale`` (None or finite > 0) are checked before any
K/V write, and by the fake implementations too.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from sgl_piecewise.checks import check_tensor
from sgl_piecewise.context import ForwardContext, get_forward_context
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError, NoForwardContextError
from sgl_piecewise.internals.fake_tensor import is_fake


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Checks that need no pool (the fake implementation runs them while tracing)."""
    check_tensor("q", q, shape=(None, None, None))
    num_tokens, num_heads, head_dim = q.shape
    check_tensor("k", k, shape=(num_tokens, None, head_dim), dtype=q.dtype, device=q.device)
    check_tensor("v", v, shape=(num_tokens, k.shape[1], None), dtype=q.dtype, device=q.device)
    if k.shape[1] == 0 or num_heads % k.shape[1] != 0:
        raise InvalidInputError(
            f"q/k heads: expected num_heads divisible by num_kv_heads, got {num_heads} and {k.shape[1]}"
        )


def _attention_into(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    scale: Optional[float],
    ctx: Optional[ForwardContext] = None,
) -> None:
    ctx = get_forward_context() if ctx is None else ctx
    _check_scale(scale)
    batch, backend = ctx.batch, ctx.backend
    pool = backend.kv_pool
    pool.check_layer(layer_id)
    n = ctx.num_tokens
    if not ctx.args_checked or ctx.debug_checks:
        _check_against_pool(q, k, v, pool, n)
    scale = _resolved_scale(q, scale)
    if backend.write_kv_and_attend(q, k, v, out, layer_id, batch, scale, n, ctx.out_cache_loc) and not ctx.debug_checks:
        ctx.layer_attend = backend.layer_attend()


def _resolved_scale(q: torch.Tensor, scale: Optional[float]) -> float:
    """The logit scale a call means: ``scale``, or 1/sqrt(head size) for None."""
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    _check_scale(scale)  # the attention between pieces resolves before it checks anything else
    return scale


def _check_scale(scale: Optional[float]) -> None:
    """Refuse NaN, infinite and non-positive scales. No module constant
    (``math.inf``): Dynamo would guard on it, and a saved compile runs only
    with guards it can check without Dynamo."""
    if scale is None or 0.0 < scale < float("inf"):
        return
    if not math.isfinite(scale):
        raise InvalidInputError(f"scale: expected a finite attention scale, got {scale!r}")
    raise InvalidInputError(f"scale: expected a positive attention scale, got {scale!r}")


def _check_traced_scale(scale: object) -> None:
    """The fake implementations' scale check; a symbolic float is left to the
    real call (comparing it would add a guard)."""
    if isinstance(scale, (int, float)):
        _check_scale(scale)


def _check_meta_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> None:
    """Plain ``meta`` tensors reach only the fake implementation: inside a
    forward context, check them against the pool as the real call would.
    FakeTensors are left alone (a trace must not read the forward context)."""
    if q.device.type != "meta" or is_fake(q):
        return
    try:
        ctx = get_forward_context()
    except NoForwardContextError:
        return
    pool = ctx.backend.kv_pool
    pool.check_layer(layer_id)
    _check_against_pool(q, k, v, pool, ctx.num_tokens)


def _check_against_pool(q, k, v, pool, num_tokens: int) -> None:
    pool.check_kv_rows("k", k)
    check_tensor("v", v, shape=(None, pool.num_kv_heads, None), dtype=pool.dtype, device=pool.device)
    if q.shape[0] < num_tokens:
        raise InvalidInputError(
            f"q: expected at least the batch's {num_tokens} tokens, got {q.shape[0]}; "
            f"was the forward context entered with the right batch?"
        )


@torch.library.custom_op("sgl_piecewise::unified_attention", mutates_args=())
def _unified_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scale: Optional[float] = None
) -> torch.Tensor:
    _check_shapes(q, k, v)
    out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
    _attention_into(q, k, v, out, layer_id, scale)
    return out


@_unified_attention.register_fake
def _unified_attention_fake(q, k, v, layer_id, scale=None):
    _check_shapes(q, k, v)
    _check_traced_scale(scale)
    _check_meta_call(q, k, v, layer_id)
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


@torch.library.custom_op("sgl_piecewise::unified_attention_with_output", mutates_args=("output",))
def _unified_attention_with_output(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    output: torch.Tensor,
    layer_id: int,
    scale: Optional[float] = None,
) -> None:
    _check_shapes(q, k, v)
    _check_output(q, v, output)
    _attention_into(q, k, v, output, layer_id, scale)


@_unified_attention_with_output.register_fake
def _unified_attention_with_output_fake(q, k, v, output, layer_id, scale=None):
    _check_shapes(q, k, v)
    _check_output(q, v, output)
    _check_traced_scale(scale)
    _check_meta_call(q, k, v, layer_id)


def attention_with_output_direct(q, k, v, output, layer_id: int, scale: Optional[float] = None) -> None:
    """The out variant without the dispatcher (whose autograd layers cost
    host time per layer per step), for the attention between compiled
    pieces. Arguments are checked at the step's first layer (every layer
    under ``debug_checks``); later layers take the backend's per-step
    launch where it has one.
    """
    ctx = get_forward_context()
    attend = ctx.layer_attend
    if attend is not None and attend(q, k, v, output, layer_id, _resolved_scale(q, scale)):
        return
    if not ctx.args_checked or ctx.debug_checks:
        _check_shapes(q, k, v)
        _check_output(q, v, output)
    _attention_into(q, k, v, output, layer_id, scale, ctx)
    ctx.args_checked = True


def _check_output(q: torch.Tensor, v: torch.Tensor, output: torch.Tensor) -> None:
    check_tensor("output", output, shape=tuple(q.shape[:-1]) + (v.shape[-1],), dtype=q.dtype, device=q.device)


def unified_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layer_id: int, scale: Optional[float] = None
) -> torch.Tensor:
    """Write K/V for the new tokens, attend, return ``[T, Hq, Dv]``."""
    _check_scalar_args(layer_id, scale)
    return torch.ops.sgl_piecewise.unified_attention(q, k, v, layer_id, scale)


def unified_attention_with_output(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    output: torch.Tensor,
    *,
    layer_id: int,
    scale: Optional[float] = None,
) -> None:
    """Like :func:`unified_attention`, writing into ``output [T, Hq, Dv]``."""
    _check_scalar_args(layer_id, scale)
    torch.ops.sgl_piecewise.unified_attention_with_output(q, k, v, output, layer_id, scale)


def _check_scalar_args(layer_id: object, scale: object) -> None:
    """Before the dispatcher, which takes ``True`` as layer 1 and fails obscurely on ``1.0``."""
    if isinstance(layer_id, bool) or not isinstance(layer_id, int):
        raise InvalidTypeError(f"layer_id: expected an int, got {layer_id!r} ({type(layer_id).__name__})")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise InvalidTypeError(f"scale: expected a float or None, got {scale!r} ({type(scale).__name__})")
    _check_scale(scale)
