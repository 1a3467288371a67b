"""The runners' registries, batch-padded (whole-model graphs) or token-padded
(ragged batches); padding invariants: docs/ARCHITECTURE.md, "Padding invariants"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Tuple, Union

import torch

from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.graphs.buffer_registry import (
    CudaGraphBufferRegistry,
    FillContext,
    MissingSource,
    PaddingPolicy,
    SizedValue,
    check_count,
)
from sgl_piecewise.graphs.graph_slot import SharedBufferPool
from sgl_piecewise.memory import DUMMY_SLOT

Device = Union[torch.device, str]

DECODE_SLOTS = (
    "input_ids",
    "positions",
    "out_cache_loc",
    "num_token_non_padded",
    "seq_lens",
    "seq_lens_cpu",
    "req_pool_indices",
    "extend_seq_lens",
)
DECODE_OPTIONAL_SLOTS = ("accept_lengths",)  # with_accept_lengths=True
PREFILL_SLOTS = DECODE_SLOTS + ("extend_prefix_lens",)


def _check_attn_tp(attn_tp_size: int, attn_tp_rank: int) -> None:
    check_positive_int("attn_tp_size", attn_tp_size)
    if not isinstance(attn_tp_rank, int) or not 0 <= attn_tp_rank < attn_tp_size:
        raise InvalidInputError(f"attn_tp_rank: expected an int in [0, {attn_tp_size}), got {attn_tp_rank!r}")


def compute_local_num_token_non_padded(
    global_num: Union[int, torch.Tensor],
    num_tokens_per_dp: int,
    attn_tp_size: int = 1,
    attn_tp_rank: int = 0,
) -> Union[int, torch.Tensor]:
    """Real tokens among this attention-TP rank's share of ``num_tokens_per_dp`` padded rows."""
    _check_attn_tp(attn_tp_size, attn_tp_rank)
    check_count("num_tokens_per_dp", num_tokens_per_dp)
    if num_tokens_per_dp % attn_tp_size:
        raise InvalidInputError(
            f"num_tokens_per_dp: expected a multiple of attn_tp_size={attn_tp_size}, "
            f"got {num_tokens_per_dp}; pad the token count to a multiple first"
        )
    per_rank = num_tokens_per_dp // attn_tp_size
    start = per_rank * attn_tp_rank
    if isinstance(global_num, torch.Tensor):
        return torch.clamp(global_num - start, min=0, max=per_rank)
    return min(max(check_count("global_num", global_num) - start, 0), per_rank)


def num_token_non_padded_for(ctx: FillContext, attn_tp_size: int = 1, attn_tp_rank: int = 0) -> int:
    """The value capture and replay both write for a fill of ``ctx``'s sizes."""
    return compute_local_num_token_non_padded(ctx.raw_num_tokens, ctx.padded_num_tokens, attn_tp_size, attn_tp_rank)


def num_token_non_padded_value(attn_tp_size: int = 1, attn_tp_rank: int = 0) -> SizedValue:
    """The ``num_token_non_padded`` slot's ``value_from_sizes``: it reads the
    sizes, never the batch, so capture and replay cannot disagree."""
    _check_attn_tp(attn_tp_size, attn_tp_rank)

    def local_num_token_non_padded(ctx: FillContext) -> int:
        return num_token_non_padded_for(ctx, attn_tp_size, attn_tp_rank)

    return local_num_token_non_padded


def _rows_bs(max_bs: int, max_num_tokens: int) -> Tuple[int, ...]:
    return (max_bs,)


def _rows_tokens(max_bs: int, max_num_tokens: int) -> Tuple[int, ...]:
    return (max_num_tokens,)


def _scalar(max_bs: int, max_num_tokens: int) -> Tuple[int, ...]:
    return ()


_SHAPE_FNS = {"bs": _rows_bs, "tokens": _rows_tokens, "none": _scalar}


def _accept_lengths(batch: Any) -> Optional[torch.Tensor]:
    """``spec_info.accept_lengths``, or None (then padded)."""
    if isinstance(batch, Mapping):
        return batch.get("accept_lengths")
    spec = getattr(batch, "spec_info", None)
    return None if spec is None else spec.accept_lengths


def _declarer(reg: CudaGraphBufferRegistry, bind: Optional[Mapping], names: Tuple[str, ...]):
    """``declare(name, axis, dtype, policy, pad_value, **fields)``, adopting ``bind[name]``."""
    bind = dict(bind or {})
    unknown = sorted(set(bind) - set(names))
    if unknown:
        raise InvalidInputError(f"bind: expected names among {list(names)}, got {unknown}")

    def declare(name, axis, dtype, policy=PaddingPolicy.KEEP_PAD, pad_value=0, **fields):
        reg.register_slot(
            name,
            _SHAPE_FNS[axis],
            dtype,
            axis,
            padding_policy=policy,
            pad_value=pad_value,
            bind=bind.get(name),
            **fields,
        )

    return declare


def _declare_common(
    declare, seq_len_fill_value: int, attn_tp_size: int, attn_tp_rank: int, host_seq_lens: bool = True
) -> None:
    """The slots every runner's graphs read."""
    sentinel, zero = PaddingPolicy.FILL_SENTINEL, PaddingPolicy.ZERO
    # Padded rows go through the embedding: an earlier step's ids are in the vocabulary.
    declare("input_ids", "tokens", torch.int64, PaddingPolicy.FOREACH_COPY)
    declare("positions", "tokens", torch.int64, zero)
    declare("out_cache_loc", "tokens", torch.int64, sentinel, DUMMY_SLOT)
    declare(
        "num_token_non_padded",
        "none",
        torch.int32,
        copy_from_fb=False,
        value_from_sizes=num_token_non_padded_value(attn_tp_size, attn_tp_rank),
    )
    declare("seq_lens", "bs", torch.int32, sentinel, seq_len_fill_value)
    if host_seq_lens:
        declare("seq_lens_cpu", "bs", torch.int32, sentinel, seq_len_fill_value, device="cpu")
    # A padded request reads (never writes) req_to_token row 0.
    declare("req_pool_indices", "bs", torch.int64, zero)


def build_decode_registry(
    max_bs: int,
    device: Device,
    *,
    seq_len_fill_value: int,
    num_tokens_per_bs: int = 1,
    attn_tp_size: int = 1,
    attn_tp_rank: int = 0,
    with_accept_lengths: bool = False,
    host_seq_lens: bool = True,
    pool: Optional[SharedBufferPool] = None,
    bind: Optional[Mapping] = None,
    poison_tails: bool = False,
) -> CudaGraphBufferRegistry:
    """Batch-padded inputs of the whole-model graphs (slots and padded values:
    docs/ARCHITECTURE.md, "The runners' registries"); fill with
    ``FillContext.uniform``. ``bind``: name -> existing buffer to adopt.
    """
    w = check_positive_int("num_tokens_per_bs", num_tokens_per_bs)
    fill = check_count("seq_len_fill_value", seq_len_fill_value)
    _check_attn_tp(attn_tp_size, attn_tp_rank)
    names = DECODE_SLOTS + (DECODE_OPTIONAL_SLOTS if with_accept_lengths else ())
    if not host_seq_lens:
        names = tuple(n for n in names if n != "seq_lens_cpu")
    max_num_tokens = check_positive_int("max_bs", max_bs) * w
    reg = CudaGraphBufferRegistry(max_bs, max_num_tokens, device, pool=pool, poison_tails=poison_tails)
    declare = _declarer(reg, bind, names)
    _declare_common(declare, fill, attn_tp_size, attn_tp_rank, host_seq_lens)
    declare("extend_seq_lens", "bs", torch.int32, PaddingPolicy.FILL_SENTINEL, w)
    if with_accept_lengths:
        declare(
            "accept_lengths",
            "bs",
            torch.int32,
            PaddingPolicy.FILL_SENTINEL,
            w,
            source_fn=_accept_lengths,
            when_missing=MissingSource.PAD,
        )
    return reg


def build_prefill_registry(
    max_num_tokens: int,
    max_bs: int,
    device: Device,
    *,
    seq_len_fill_value: int,
    attn_tp_size: int = 1,
    attn_tp_rank: int = 0,
    pool: Optional[SharedBufferPool] = None,
    bind: Optional[Mapping] = None,
    poison_tails: bool = False,
) -> CudaGraphBufferRegistry:
    """Token-padded inputs of the piecewise and breakable graphs (EXTEND,
    MIXED), declared as in :func:`build_decode_registry`, except that a padded
    request adds no tokens and its prefix is ``seq_len_fill_value``, so
    ``prefix + new == seq_lens`` holds for it too.
    """
    fill = check_count("seq_len_fill_value", seq_len_fill_value)
    _check_attn_tp(attn_tp_size, attn_tp_rank)
    reg = CudaGraphBufferRegistry(max_bs, max_num_tokens, device, pool=pool, poison_tails=poison_tails)
    declare = _declarer(reg, bind, PREFILL_SLOTS)
    _declare_common(declare, fill, attn_tp_size, attn_tp_rank)
    declare("extend_seq_lens", "bs", torch.int32, PaddingPolicy.ZERO)
    declare("extend_prefix_lens", "bs", torch.int32, PaddingPolicy.FILL_SENTINEL, fill)
    return reg
