"""Static graph inputs, declared once: the buffer registry (upstream SGLang PR 26742).

A CUDA graph reads its inputs from fixed addresses. Before each replay the new
step's data must land at those addresses, padded rows must hold values that
are safe to compute on, and nothing else may move. When every runner copied
``ForwardBatch`` fields by hand, the copies drifted apart (upstream SGLang PR 26742). Here
each input is declared once as a :class:`GraphSlot`, and every runner — at
capture and at replay alike — fills all of them through
:meth:`CudaGraphBufferRegistry.fill_from`.

Ownership: the registry owns every buffer it allocates and adopts, without
copying, a buffer handed to ``register_slot(bind=...)``. A slot's buffer never
changes after registration, so a graph captured on ``slot.slice_for(...)``
sees every later fill.

One ``fill_from(batch, ctx)``:

1. checks ``ctx`` against the capacity and resolves and checks every source
   (a tensor; dtype castable; shape ``[raw, *buffer.shape[1:]]``; device) —
   all before writing, so a rejected fill leaves every buffer as it was;
2. resets the padded tail ``[raw, padded)`` of each copied slot by its policy;
3. copies every head ``[:raw]`` with one ``torch._foreach_copy_`` per
   (device, dst dtype, src dtype) group, per tensor if that call raises,
   and writes the ``value_from_sizes`` slots;
4. runs the ``post_fill(slot, batch, ctx)`` hooks in registration order.

Steps 2 and 3 are the same for every fill of one set of sizes, so the
registry plans them once per set (:class:`_FillPlan`: the views to copy
into, grouped). The plan copies the tails and the sized values from
constants the registry keeps, in the same grouped copies as the heads: a
replay's fill is one copy per (device, dtype), however it is padded, where
a ``fill_`` per tail would add a launch each. A fill whose every source copies as
it is (the usual step: the slot's dtype and device, the raw rows' shape)
runs the plan after checking only that; any other fill (a cast, a missing
source, an error to report) takes the checked path of steps 1-3, which
writes the same values.

``graph_slot`` defines the slot, its policies and ``FillContext``
(re-exported here); ``input_registries`` declares the registries of the
runners (``build_decode_registry``, ``build_prefill_registry``) and the pool
they share.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple, Union

import torch

from sgl_piecewise.checks import check_positive_int, check_tensor, same_device
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError
from sgl_piecewise.graphs.graph_slot import (  # noqa: F401 (AXES, check_count: re-exported)
    AXES,
    FillContext,
    GraphSlot,
    MissingSource,
    PaddingPolicy,
    PadValue,
    PostFill,
    ShapeFn,
    SharedBufferPool,
    SizedValue,
    SliceFn,
    SourceFn,
    canonical_device,
    check_count,
)

logger = logging.getLogger(__name__)


@dataclass
class RegistryStats:
    """Counters of one registry (checked exactly by tests and ``verify``)."""

    fills: int = 0
    foreach_copies: int = 0  # grouped copies done by one torch._foreach_copy_
    per_tensor_fallbacks: int = 0  # groups copied tensor by tensor instead
    last_fallback_reason: Optional[str] = None


class _Fill(NamedTuple):
    """A slot's part in one fill. ``src is None``: every row is padding (MissingSource.PAD)."""

    slot: GraphSlot
    src: Optional[torch.Tensor]
    raw: int
    padded: int


class _CopyGroup(NamedTuple):
    """One ``torch._foreach_copy_`` of a planned fill: the batch's sources
    into the heads, then constants into the tails and sized values."""

    dsts: List[torch.Tensor]  # the heads' views, then the constants' destinations
    which: Tuple[int, ...]  # per head, the index of its source in the plan's sources
    constants: List[torch.Tensor]  # the rest's sources: registry-owned constants


class _FillPlan(NamedTuple):
    """A fill of one set of sizes whose sources copy as they are."""

    sources: Tuple[Tuple[GraphSlot, Tuple[int, ...]], ...]  # every copied slot, the shape of its source
    groups: Tuple[_CopyGroup, ...]
    fills: Tuple[Tuple[torch.Tensor, PadValue], ...]  # writes no constant serves: view, value


def _poison_value(dtype: torch.dtype) -> PadValue:
    """A value no real input has: NaN, or the most negative int (a wild index)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).min


def _source(slot: GraphSlot, batch: Any, mapping: bool) -> Any:
    """``slot``'s source in ``batch``: its ``source_fn``'s, else the item
    (``mapping``: ``isinstance(batch, Mapping)``, asked once per fill) or the
    attribute of its name, None when absent."""
    if slot.source_fn is not None:
        return slot.source_fn(batch)
    return batch.get(slot.name) if mapping else getattr(batch, slot.name, None)


def copies_as_is(src: object, dtype: torch.dtype, device: torch.device, shape: Tuple[int, ...]) -> bool:
    """Does ``src`` copy as it is into a view of this dtype, device and
    shape: a tensor of all three, so no cast and no broadcast? The usual
    source, checked without building a message: this runs per input per
    replay."""
    return type(src) is torch.Tensor and src.dtype == dtype and src.shape == shape and src.device == device


def _check_source(slot: GraphSlot, src: object, raw: int) -> None:
    buf = slot.buffer
    if slot.axis == "none":
        want, why = tuple(buf.shape), "the whole buffer"
    else:
        want, why = (raw, *buf.shape[1:]), f"raw {slot.axis} count {raw}"
    if copies_as_is(src, buf.dtype, buf.device, want):
        return
    where = f"slot {slot.name!r}: source"
    if not isinstance(src, torch.Tensor):
        raise InvalidTypeError(f"{where}: expected a torch.Tensor, got {type(src).__name__}")
    if not same_device(src.device, buf.device):
        raise InvalidInputError(
            f"{where}: expected device {buf.device}, got {src.device}; move the batch to the graph's device first"
        )
    # Widening only: int64 -> int32 is a "safe" cast to torch, but values
    # past 2**31 would wrap silently.
    if torch.promote_types(src.dtype, buf.dtype) != buf.dtype:
        raise InvalidInputError(
            f"{where}: expected a dtype that casts safely to {buf.dtype} (the same or a narrower "
            f"one of its kind), got {src.dtype}"
        )
    if tuple(src.shape) != want:
        raise InvalidInputError(f"{where}: expected shape {list(want)} ({why}), got {list(src.shape)}")


def _tail_value(slot: GraphSlot, poison_tails: bool) -> Optional[PadValue]:
    """What a fill writes into the slot's padded tail (None: nothing)."""
    policy = slot.padding_policy
    if policy is PaddingPolicy.FILL_SENTINEL:
        return slot.pad_value
    if policy is PaddingPolicy.ZERO:
        return 0
    if policy is PaddingPolicy.KEEP_PAD and poison_tails:
        return _poison_value(slot.dtype)
    return None


def _usual_sources(plan: _FillPlan, batch: Any) -> Optional[List[torch.Tensor]]:
    """Every copied slot's source, if each copies as it is (``copies_as_is``,
    against the plan's shapes); else None."""
    sources = []
    mapping = isinstance(batch, Mapping)
    for slot, shape in plan.sources:
        src = _source(slot, batch, mapping)
        if not copies_as_is(src, slot.dtype, slot.device, shape):
            return None
        sources.append(src)
    return sources


def _sized_value(slot: GraphSlot, ctx: FillContext) -> PadValue:
    """``slot.value_from_sizes(ctx)``, checked to be a number."""
    value = slot.value_from_sizes(ctx)
    if not isinstance(value, (bool, int, float)):
        raise InvalidTypeError(f"slot {slot.name!r}: value_from_sizes: expected a number, got {value!r}")
    return value


def _value_key(value: PadValue) -> Tuple[type, Any]:
    """A dict key for a pad value: NaN equals itself here, and 1, 1.0 and True differ."""
    return type(value), ("nan" if value != value else value)


# Plans kept per registry: one per set of sizes filled, bounded against a
# caller that fills ever new raw counts.
_MAX_PLANS = 1024
# The largest constant (elements) a registry keeps to copy pad values from;
# a tail larger than this is written with fill_ instead.
_MAX_CONSTANT_NUMEL = 1 << 18


class CudaGraphBufferRegistry:
    """Owns the static inputs of one runner's graphs (module docstring: fill steps).

    ``max_bs`` / ``max_num_tokens``: the largest captured sizes; every buffer
    holds at least that many rows along its axis. ``pool``: allocate through a
    ``graph_slot.SharedBufferPool``, so registries alias identical buffers.
    ``poison_tails`` (debug): KEEP_PAD tails get a value no computation
    survives (NaN, the most negative int), so a graph that reads them shows it.
    """

    def __init__(
        self,
        max_bs: int,
        max_num_tokens: int,
        device: Union[torch.device, str],
        *,
        pool: Optional[SharedBufferPool] = None,
        poison_tails: bool = False,
    ):
        self.max_bs = check_positive_int("max_bs", max_bs)
        self.max_num_tokens = check_positive_int("max_num_tokens", max_num_tokens)
        self.device = canonical_device(device)
        self.pool = pool
        self.poison_tails = bool(poison_tails)
        self.stats = RegistryStats()
        self._slots: Dict[str, GraphSlot] = {}
        self._plans: Dict[Tuple[int, int, int, int], _FillPlan] = {}  # by the sizes of a FillContext
        # Flat tensors holding one pad value each, by (device, dtype, value):
        # tails copy from their prefixes within the fill's grouped copies.
        self._constants: Dict[Tuple[torch.device, torch.dtype, Tuple[type, Any]], torch.Tensor] = {}

    # ---- declaration ------------------------------------------------------
    def register_slot(
        self,
        name: str,
        shape_fn: Optional[ShapeFn],
        dtype: torch.dtype,
        axis: str,
        *,
        device: Union[torch.device, str, None] = None,
        padding_policy: PaddingPolicy = PaddingPolicy.KEEP_PAD,
        pad_value: PadValue = 0,
        post_fill: Optional[PostFill] = None,
        slice_fn: Optional[SliceFn] = None,
        source_fn: Optional[SourceFn] = None,
        copy_from_fb: bool = True,
        bind: Optional[torch.Tensor] = None,
        when_missing: MissingSource = MissingSource.ERROR,
        value_from_sizes: Optional[SizedValue] = None,
    ) -> GraphSlot:
        """Declare a slot; allocate its buffer, or adopt ``bind`` (same storage, no copy)."""
        slot = GraphSlot(name, shape_fn, dtype, axis, device, padding_policy, pad_value, post_fill,
                         slice_fn, source_fn, copy_from_fb, bind, when_missing, value_from_sizes)  # fmt: skip
        return self.register(slot)

    def register(self, slot: GraphSlot) -> GraphSlot:
        """Add a declared slot (``slot.buffer`` set: adopt it); return the registered slot."""
        if slot.name in self._slots:
            raise InvalidInputError(
                f"slot {slot.name!r}: expected a new name, got a duplicate (registered: {list(self._slots)})"
            )
        device = canonical_device(slot.device if slot.device is not None else self.device)
        buffer = self._allocate(slot, device) if slot.buffer is None else self._adopt(slot, device)
        slot = dataclasses.replace(slot, device=device, buffer=buffer)
        self._slots[slot.name] = slot
        self._plans.clear()
        return slot

    def _rows_needed(self, axis: str) -> Optional[int]:
        return {"bs": self.max_bs, "tokens": self.max_num_tokens}.get(axis)

    def _shape(self, slot: GraphSlot) -> Tuple[int, ...]:
        shape = tuple(slot.shape_fn(self.max_bs, self.max_num_tokens))
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise InvalidInputError(f"slot {slot.name!r}: shape_fn: expected a tuple of ints >= 0, got {shape!r}")
        need = self._rows_needed(slot.axis)
        if need is not None and (not shape or shape[0] < need):
            raise InvalidInputError(
                f"slot {slot.name!r}: expected at least {need} rows along {slot.axis} "
                f"(the registry's maximum), got shape {list(shape)}"
            )
        return shape

    def _allocate(self, slot: GraphSlot, device: torch.device) -> torch.Tensor:
        shape = self._shape(slot)
        # A FILL_ONCE constant must not alias a buffer that other fills rewrite.
        if self.pool is not None and slot.padding_policy is not PaddingPolicy.FILL_ONCE:
            numel = math.prod(shape)
            buf = self.pool.share_input_buffer(slot.name, numel, slot.dtype, device).view(shape)
        else:
            buf = torch.empty(shape, dtype=slot.dtype, device=device)
        # Never uninitialised memory: a graph captured before the first fill
        # reads the policy's values, the same on every run.
        if slot.padding_policy in (PaddingPolicy.FILL_SENTINEL, PaddingPolicy.FILL_ONCE):
            buf.fill_(slot.pad_value)
        else:
            buf.zero_()
        return buf

    def _adopt(self, slot: GraphSlot, device: torch.device) -> torch.Tensor:
        """Take the caller's buffer as is: its owner may have filled it already."""
        where = f"slot {slot.name!r}: bind"
        buf = check_tensor(where, slot.buffer, dtype=slot.dtype, device=device)
        want = list(self._shape(slot)) if slot.shape_fn is not None else None
        need = self._rows_needed(slot.axis)
        if need is None:  # axis "none": the whole buffer is the graph input
            ok = want is None or list(buf.shape) == want
        else:
            ok = buf.dim() >= 1 and buf.shape[0] >= need
            ok = ok and (want is None or list(buf.shape[1:]) == want[1:])
        if not ok:
            raise InvalidInputError(
                f"{where}: expected shape {want or [need, '*']} (at least {need} rows along "
                f"{slot.axis}), got {list(buf.shape)}"
            )
        if slot.padding_policy is PaddingPolicy.FILL_ONCE:
            buf.fill_(slot.pad_value)
        return buf

    # ---- access -----------------------------------------------------------
    def get_slot(self, name: str) -> GraphSlot:
        if name not in self._slots:
            raise InvalidInputError(f"slot: expected one of {list(self._slots)}, got {name!r}")
        return self._slots[name]

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(self._slots)

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def __iter__(self) -> Iterator[GraphSlot]:
        return iter(self._slots.values())

    def __len__(self) -> int:
        return len(self._slots)

    def extract(self, ctx: FillContext) -> Dict[str, torch.Tensor]:
        """Name -> the padded view a graph of ``ctx``'s sizes reads (its inputs)."""
        self._check_ctx(ctx)
        bs, tokens = ctx.padded_bs, ctx.padded_num_tokens
        return {name: slot.slice_for(bs, tokens) for name, slot in self._slots.items()}

    # ---- filling ----------------------------------------------------------
    def fill_from(self, batch_or_sources: Any, ctx: FillContext) -> None:
        """Write one step into every slot: check, pad tails, grouped copy, hooks.

        ``batch_or_sources``: a ``ForwardBatch`` (any object whose attributes
        are the slot names) or a mapping name -> tensor; hooks receive it as is.
        """
        self._check_ctx(ctx)
        plan = self._fill_plan(ctx)
        sources = _usual_sources(plan, batch_or_sources)
        if sources is None:
            self._fill_checked(batch_or_sources, ctx)
        else:
            for view, value in plan.fills:
                view.fill_(value)
            for group in plan.groups:
                self._copy_group(group.dsts, [sources[i] for i in group.which] + group.constants)
        for slot in self._slots.values():
            if slot.post_fill is not None:
                slot.post_fill(slot, batch_or_sources, ctx)
        self.stats.fills += 1

    def _fill_checked(self, batch_or_sources: Any, ctx: FillContext) -> None:
        """Steps 1-3 for any sources: each resolved and checked, with the
        error that names the slot, then tails reset and heads copied."""
        # Check everything first: a rejected fill must not leave half a step behind.
        mapping = isinstance(batch_or_sources, Mapping)
        plans = (self._plan(slot, batch_or_sources, mapping, ctx) for slot in self._slots.values())
        fills = [f for f in plans if f is not None]
        values = [(slot, _sized_value(slot, ctx)) for slot in self._slots.values() if slot.value_from_sizes is not None]
        dsts: List[torch.Tensor] = []
        srcs: List[torch.Tensor] = []
        for f in fills:
            self._write_padding(f)
            if f.src is not None and f.src.numel():
                dsts.append(f.slot.buffer if f.slot.axis == "none" else f.slot.buffer[: f.raw])
                srcs.append(f.src)
        self._copy_grouped(dsts, srcs)
        for slot, value in values:
            slot.buffer.fill_(value)

    def _fill_plan(self, ctx: FillContext) -> _FillPlan:
        """Steps 2 and 3 for sources that copy as they are, planned once per
        set of sizes: what :meth:`_fill_checked` would write for them. Tails
        and sized values are copied from registry-owned constants within the
        same grouped copies as the heads, so a fill of any sizes launches one
        copy per (device, dtype) and nothing else."""
        key = (ctx.raw_bs, ctx.padded_bs, ctx.raw_num_tokens, ctx.padded_num_tokens)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        sources, fills = [], []
        # Per (device, dtype): head views, their sources' indexes, then the
        # constants' destinations and the constants.
        groups: Dict[Tuple[torch.device, torch.dtype], Tuple[list, list, list, list]] = {}

        def group(dst: torch.Tensor) -> Tuple[list, list, list, list]:
            return groups.setdefault((dst.device, dst.dtype), ([], [], [], []))

        def write(view: torch.Tensor, value: PadValue) -> None:
            constant = self._constant_like(view, value)
            if constant is None:
                fills.append((view, value))
            else:
                _, _, dsts, constants = group(view)
                dsts.append(view)
                constants.append(constant)

        for slot in self._slots.values():
            if slot.value_from_sizes is not None:
                write(slot.buffer, _sized_value(slot, ctx))
            if not slot.copy_from_fb:
                continue
            raw, padded = (None, None) if slot.axis == "none" else ctx.counts(slot.axis)
            dst = slot.buffer if raw is None else slot.buffer[:raw]
            if dst.numel():
                heads, which, _, _ = group(dst)
                heads.append(dst)
                which.append(len(sources))
            sources.append((slot, dst.shape))
            tail = _tail_value(slot, self.poison_tails) if raw is not None and raw < padded else None
            if tail is not None:
                write(slot.buffer[raw:padded], tail)
        planned = tuple(_CopyGroup(h + d, tuple(w), c) for h, w, d, c in groups.values())
        plan = _FillPlan(tuple(sources), planned, tuple(fills))
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _constant_like(self, view: torch.Tensor, value: PadValue) -> Optional[torch.Tensor]:
        """A registry-owned tensor shaped like ``view`` whose every element is
        ``value``, to copy from; None for a view that is not contiguous (a
        bound buffer's) or larger than ``_MAX_CONSTANT_NUMEL``."""
        numel = view.numel()
        if not view.is_contiguous() or numel > _MAX_CONSTANT_NUMEL:
            return None
        key = (view.device, view.dtype, _value_key(value))
        constant = self._constants.get(key)
        if constant is None or constant.numel() < numel:
            # Sized for every row of every slot, so it is rarely made again;
            # plans made earlier keep the views of the one they took.
            rows = max(self.max_bs, self.max_num_tokens, numel)
            constant = torch.full((min(rows, _MAX_CONSTANT_NUMEL),), value, dtype=view.dtype, device=view.device)
            self._constants[key] = constant
        return constant[:numel].view(view.shape)

    def _check_ctx(self, ctx: FillContext) -> None:
        if not isinstance(ctx, FillContext):
            raise InvalidTypeError(f"ctx: expected a FillContext, got {type(ctx).__name__}")
        for field, size, limit in (
            ("padded_bs", ctx.padded_bs, self.max_bs),
            ("padded_num_tokens", ctx.padded_num_tokens, self.max_num_tokens),
        ):
            if size > limit:
                raise InvalidInputError(
                    f"FillContext.{field}: expected at most {limit} (the registry's maximum), "
                    f"got {size}; run this batch eagerly or build a larger registry"
                )

    def _plan(self, slot: GraphSlot, batch: Any, mapping: bool, ctx: FillContext) -> Optional[_Fill]:
        if not slot.copy_from_fb:
            return None  # written only by its hook; its source is never read
        raw, padded = (0, 0) if slot.axis == "none" else ctx.counts(slot.axis)
        src = _source(slot, batch, mapping)
        if src is None:
            if slot.when_missing is MissingSource.ERROR:
                raise InvalidInputError(
                    f"slot {slot.name!r}: expected a source tensor, got None (field missing or "
                    f"None); declare when_missing=SKIP or PAD if the field is optional"
                )
            if slot.when_missing is MissingSource.SKIP:
                return None
            return _Fill(slot, None, raw, padded)
        _check_source(slot, src, raw)
        return _Fill(slot, src, raw, padded)

    def _write_padding(self, f: _Fill) -> None:
        slot, buf = f.slot, f.slot.buffer
        if f.src is None:  # MissingSource.PAD: every row is padding
            (buf if slot.axis == "none" else buf[: f.padded]).fill_(slot.pad_value)
            return
        if slot.axis == "none" or f.raw == f.padded:
            return
        value = _tail_value(slot, self.poison_tails)
        if value is not None:
            buf[f.raw : f.padded].fill_(value)

    def _copy_grouped(self, dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
        # One foreach call takes tensors of one device, and its fast path one
        # (dst, src) dtype pair. Sources are checked to be on their slot's
        # device, so every copy is stream-ordered and non_blocking would change
        # nothing.
        groups: Dict[Tuple[torch.device, torch.dtype, torch.dtype], Tuple[list, list]] = {}
        for dst, src in zip(dsts, srcs):
            group = groups.setdefault((dst.device, dst.dtype, src.dtype), ([], []))
            group[0].append(dst)
            group[1].append(src)
        for group_dsts, group_srcs in groups.values():
            self._copy_group(group_dsts, group_srcs)

    def _copy_group(self, dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
        foreach = getattr(torch, "_foreach_copy_", None)
        if foreach is None:
            reason = "this torch has no torch._foreach_copy_"
        else:
            try:
                foreach(dsts, srcs)
                self.stats.foreach_copies += 1
                return
            except Exception as exc:  # any failure of the fast path is retried per tensor
                reason = f"torch._foreach_copy_ raised {type(exc).__name__}: {exc}"
        self.stats.per_tensor_fallbacks += 1
        self.stats.last_fallback_reason = reason
        # Warn once per registry: this runs before every replay.
        level = logging.WARNING if self.stats.per_tensor_fallbacks == 1 else logging.DEBUG
        logger.log(level, "registry: copying %d tensors one by one: %s", len(dsts), reason)
        for dst, src in zip(dsts, srcs):
            dst.copy_(src)
