"""The registries of the runners, the pool they share, and the one count of real tokens.

``build_decode_registry`` declares the inputs of the whole-model graphs
(``CudaGraphRunner``), padded along the batch: every request, padded ones
too, has ``num_tokens_per_bs`` new tokens (1 for DECODE, the draft width for
TARGET_VERIFY and DRAFT_EXTEND_V2). ``build_prefill_registry`` declares the
token-axis inputs of a step-level graph over ragged batches (EXTEND, MIXED);
the Dynamo backend pads its own graph's inputs with a registry of its own.

Padding invariants (docs/ARCHITECTURE.md, "Graph inputs: the registry"), in both:

* padded ``seq_lens`` (device and host copy) = the backend's fill value;
* padded ``out_cache_loc`` = ``DUMMY_SLOT``: padded tokens write K/V only there;
* padded ``positions`` = 0, inside every rotary table;
* ``num_token_non_padded`` is a function of the fill's sizes alone, so a
  capture (which fills its dummies through the same registry) and a replay of
  the same sizes write the same value (upstream SGLang PR 22404).
"""

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


# ---- num_token_non_padded (upstream SGLang PR 22404) -----------------------------------
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
    """Real tokens among this attention-TP rank's rows of a padded token block.

    The ``num_tokens_per_dp`` (padded) rows are split evenly over
    ``attn_tp_size`` ranks; rank ``r`` holds rows ``[r * per_rank, (r+1) *
    per_rank)``, of which ``clamp(global_num - r * per_rank, 0, per_rank)``
    are real. With ``attn_tp_size=1`` this is ``global_num`` (which never
    exceeds the padded count). A tensor ``global_num`` stays on its device.
    """
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
    """The ``value_from_sizes`` of the ``num_token_non_padded`` slot:
    :func:`num_token_non_padded_for` of each fill's sizes.

    It reads the sizes, never the batch's own field, so the dummy batch of a
    capture and the real batch of a replay cannot disagree.
    """
    _check_attn_tp(attn_tp_size, attn_tp_rank)

    def local_num_token_non_padded(ctx: FillContext) -> int:
        return num_token_non_padded_for(ctx, attn_tp_size, attn_tp_rank)

    return local_num_token_non_padded


# ---- declarations -----------------------------------------------------------
def _rows_bs(max_bs: int, max_num_tokens: int) -> Tuple[int, ...]:
    return (max_bs,)


def _rows_tokens(max_bs: int, max_num_tokens: int) -> Tuple[int, ...]:
    return (max_num_tokens,)


def _scalar(max_bs: int, max_num_tokens: int) -> Tuple[int, ...]:
    return ()


_SHAPE_FNS = {"bs": _rows_bs, "tokens": _rows_tokens, "none": _scalar}


def _accept_lengths(batch: Any) -> Optional[torch.Tensor]:
    """``spec_info.accept_lengths``, or None without spec_info (then padded)."""
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
        reg.register_slot(name, _SHAPE_FNS[axis], dtype, axis, padding_policy=policy,
                          pad_value=pad_value, bind=bind.get(name), **fields)  # fmt: skip

    return declare


def _declare_common(declare, seq_len_fill_value: int, attn_tp_size: int, attn_tp_rank: int,
                    host_seq_lens: bool = True) -> None:  # fmt: skip
    """The slots every runner's graphs read, with the padding invariants of
    docs/ARCHITECTURE.md; ``seq_lens_cpu`` only with ``host_seq_lens``."""
    sentinel, zero = PaddingPolicy.FILL_SENTINEL, PaddingPolicy.ZERO
    # Padded rows still go through the embedding: their ids must be in the
    # vocabulary, and an earlier step's ids (or the initial zeros) are.
    declare("input_ids", "tokens", torch.int64, PaddingPolicy.FOREACH_COPY)
    declare("positions", "tokens", torch.int64, zero)
    declare("out_cache_loc", "tokens", torch.int64, sentinel, DUMMY_SLOT)
    declare("num_token_non_padded", "none", torch.int32, copy_from_fb=False,
            value_from_sizes=num_token_non_padded_value(attn_tp_size, attn_tp_rank))  # fmt: skip
    declare("seq_lens", "bs", torch.int32, sentinel, seq_len_fill_value)
    if host_seq_lens:  # host copy for the backend's replay hook, padded alike
        declare("seq_lens_cpu", "bs", torch.int32, sentinel, seq_len_fill_value, device="cpu")
    # A padded request reads (never writes) req_to_token row 0: harmless.
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
    """Batch-padded inputs of the whole-model graphs; fill with ``FillContext.uniform``.

    ============================  =======  ==============  ==========================
    slot                          axis     policy          padded value
    ============================  =======  ==============  ==========================
    input_ids [bs*w] int64        tokens   FOREACH_COPY    an earlier step's ids
    positions [bs*w] int64        tokens   ZERO            0
    out_cache_loc [bs*w] int64    tokens   FILL_SENTINEL   DUMMY_SLOT
    num_token_non_padded [] i32   none     KEEP_PAD        (from the sizes, upstream SGLang PR 22404)
    seq_lens, seq_lens_cpu [bs]   bs       FILL_SENTINEL   seq_len_fill_value
    req_pool_indices [bs] int64   bs       ZERO            0
    extend_seq_lens [bs] int32    bs       FILL_SENTINEL   w
    accept_lengths [bs] int32     bs       FILL_SENTINEL   w (opt-in; spec_info None: all w)
    ============================  =======  ==============  ==========================

    ``w = num_tokens_per_bs`` (1 for DECODE, draft tokens for TARGET_VERIFY).
    Padded accept lengths are ``w`` so that, at capture, ``max(accept_lengths)``
    is the uniform width (upstream SGLang PR 25002). ``host_seq_lens=False``:
    no ``seq_lens_cpu`` slot, for a backend whose replay hook reads no host
    lengths (``AttentionBackend.replay_reads_host_lengths``). ``bind``: name ->
    existing buffer to adopt. ``pool``: share buffers with other registries.
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
        declare("accept_lengths", "bs", torch.int32, PaddingPolicy.FILL_SENTINEL, w,
                source_fn=_accept_lengths, when_missing=MissingSource.PAD)  # fmt: skip
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
    """Token-padded inputs of the piecewise and breakable graphs (EXTEND, MIXED).

    ``input_ids``, ``positions``, ``out_cache_loc`` (tokens axis),
    ``num_token_non_padded``, ``seq_lens``, ``seq_lens_cpu`` and
    ``req_pool_indices`` are declared as in :func:`build_decode_registry`.
    Along the batch, a padded request adds no tokens (``extend_seq_lens``:
    ZERO) and its ``extend_prefix_lens`` is ``seq_len_fill_value``
    (FILL_SENTINEL), so ``prefix + new == seq_lens`` holds for it too.
    """
    fill = check_count("seq_len_fill_value", seq_len_fill_value)
    _check_attn_tp(attn_tp_size, attn_tp_rank)
    reg = CudaGraphBufferRegistry(max_bs, max_num_tokens, device, pool=pool, poison_tails=poison_tails)
    declare = _declarer(reg, bind, PREFILL_SLOTS)
    _declare_common(declare, fill, attn_tp_size, attn_tp_rank)
    declare("extend_seq_lens", "bs", torch.int32, PaddingPolicy.ZERO)
    declare("extend_prefix_lens", "bs", torch.int32, PaddingPolicy.FILL_SENTINEL, fill)
    return reg
