"""Static graph inputs, declared once as :class:`GraphSlot` s and filled alike
at capture and replay. A slot's buffer never changes after registration.

One ``fill_from(batch, ctx)``:

1. checks ``ctx`` and every source (tensor, device, shape
   ``[raw, *buffer.shape[1:]]``, a widening dtype) before writing anything;
2. resets each copied slot's padded tail ``[raw, padded)`` by its policy;
3. copies the heads ``[:raw]`` with one foreach copy (``internals/foreach_copy.py``) per
   (device, dtype) group and writes the ``value_from_sizes`` slots;
4. runs the ``post_fill`` hooks in registration order.

Steps 2-3 are planned once per set of sizes and source dtypes
(:class:`_FillPlan`): tails and sized values copy from registry-owned
constants within the heads' grouped copies, so a fill is one copy per
(device, dtype); a later fill of the same kinds only checks each source's
shape and device.
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
from sgl_piecewise.internals import foreach_copy

logger = logging.getLogger(__name__)


@dataclass
class RegistryStats:
    """Counters of one registry (checked exactly by tests and ``verify``)."""

    fills: int = 0
    foreach_copies: int = 0  # grouped copies done in one foreach launch
    per_tensor_fallbacks: int = 0  # groups copied tensor by tensor instead
    last_fallback_reason: Optional[str] = None


class _CopyGroup(NamedTuple):
    """One grouped copy of a plan: sources into heads, then constants."""

    dsts: List[torch.Tensor]  # heads, then the constants' destinations
    which: Tuple[int, ...]  # per head, its source's index
    constants: List[torch.Tensor]


class _FillPlan(NamedTuple):
    """A fill of one set of sizes and source kinds (:func:`_source_kind`)."""

    sources: Tuple[Tuple[int, GraphSlot, Tuple[int, ...]], ...]  # source index, its slot, its shape
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
    """``slot``'s source in ``batch`` (item or attribute of its name), None when absent."""
    if slot.source_fn is not None:
        return slot.source_fn(batch)
    return batch.get(slot.name) if mapping else getattr(batch, slot.name, None)


def _check_source(slot: GraphSlot, src: object, want: Tuple[int, ...]) -> None:
    """Refuse a source that is no tensor, or has another device or shape than
    ``want``, or a dtype that would narrow into the slot's."""
    buf = slot.buffer
    why = "the whole buffer" if slot.axis == "none" else f"raw {slot.axis} count {want[0]}"
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
    if tuple(src.shape) != tuple(want):
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


def _missing_is_padding(slot: GraphSlot) -> bool:
    """A missing source: raise (ERROR), or whether its whole view is padding (PAD) or left (SKIP)."""
    if slot.when_missing is MissingSource.ERROR:
        raise InvalidInputError(
            f"slot {slot.name!r}: expected a source tensor, got None (field missing or "
            f"None); declare when_missing=SKIP or PAD if the field is optional"
        )
    return slot.when_missing is MissingSource.PAD


def _source_kind(src: object) -> object:
    """What a plan depends on in a source: None (missing), its dtype, or its type."""
    if src is None:
        return None
    return src.dtype if isinstance(src, torch.Tensor) else type(src)


def _sized_value(slot: GraphSlot, ctx: FillContext) -> PadValue:
    value = slot.value_from_sizes(ctx)
    if not isinstance(value, (bool, int, float)):
        raise InvalidTypeError(f"slot {slot.name!r}: value_from_sizes: expected a number, got {value!r}")
    return value


def _value_key(value: PadValue) -> Tuple[type, Any]:
    """A dict key for a pad value: NaN equals itself here, and 1, 1.0 and True differ."""
    return type(value), ("nan" if value != value else value)


_MAX_PLANS = 1024  # per registry, against a caller that fills ever new sizes
_MAX_CONSTANT_NUMEL = 1 << 18  # a larger tail is written with fill_


class CudaGraphBufferRegistry:
    """Owns the static inputs of one runner's graphs.

    ``pool``: a ``SharedBufferPool``, so registries alias identical buffers.
    ``poison_tails`` (debug): KEEP_PAD tails get NaN or the most negative int,
    so a graph that reads them shows it.
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
        self._copied: Tuple[GraphSlot, ...] = ()  # the slots a fill copies a source into
        self._plans: Dict[tuple, _FillPlan] = {}  # by a FillContext's sizes and the sources' kinds
        # By (device, dtype, value): flat tensors of one pad value each.
        self._constants: Dict[Tuple[torch.device, torch.dtype, Tuple[type, Any]], torch.Tensor] = {}

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
        slot = GraphSlot(
            name,
            shape_fn,
            dtype,
            axis,
            device,
            padding_policy,
            pad_value,
            post_fill,
            slice_fn,
            source_fn,
            copy_from_fb,
            bind,
            when_missing,
            value_from_sizes,
        )
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
        self._copied = tuple(s for s in self._slots.values() if s.copy_from_fb)
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
        # Never uninitialised: a graph captured before the first fill reads the policy's values.
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

    def fill_from(self, batch_or_sources: Any, ctx: FillContext) -> None:
        """Write one step into every slot (module docstring: the steps).
        ``batch_or_sources``: an object with the slot names as attributes, or a
        mapping name -> tensor."""
        self._check_ctx(ctx)
        mapping = isinstance(batch_or_sources, Mapping)
        sources = [_source(slot, batch_or_sources, mapping) for slot in self._copied]
        plan = self._fill_plan(ctx, sources)
        # Every source is checked before the first write: a rejected fill leaves no half step.
        for i, slot, shape in plan.sources:
            src = sources[i]
            if type(src) is not torch.Tensor or src.shape != shape or src.device != slot.device:
                _check_source(slot, src, shape)
        for view, value in plan.fills:
            view.fill_(value)
        for group in plan.groups:
            self._copy_group(group.dsts, [sources[i] for i in group.which] + group.constants)
        for slot in self._slots.values():
            if slot.post_fill is not None:
                slot.post_fill(slot, batch_or_sources, ctx)
        self.stats.fills += 1

    def _fill_plan(self, ctx: FillContext, sources: List[Any]) -> _FillPlan:
        """Steps 2-3, planned once per set of sizes and source kinds."""
        kinds = tuple([src.dtype if type(src) is torch.Tensor else _source_kind(src) for src in sources])
        key = (ctx.raw_bs, ctx.padded_bs, ctx.raw_num_tokens, ctx.padded_num_tokens, kinds)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        copied, fills = [], []
        # Per (device, dtype, source dtype): heads, their sources' indexes, constants' destinations, constants.
        groups: Dict[Tuple[torch.device, torch.dtype, Any], Tuple[list, list, list, list]] = {}

        def group(dst: torch.Tensor, src_dtype: Any) -> Tuple[list, list, list, list]:
            return groups.setdefault((dst.device, dst.dtype, src_dtype), ([], [], [], []))

        def write(view: torch.Tensor, value: PadValue) -> None:
            constant = self._constant_like(view, value)
            if constant is None:
                fills.append((view, value))
            else:
                _, _, dsts, constants = group(view, view.dtype)
                dsts.append(view)
                constants.append(constant)

        index = {slot.name: i for i, slot in enumerate(self._copied)}
        for slot in self._slots.values():
            if slot.value_from_sizes is not None:
                write(slot.buffer, _sized_value(slot, ctx))
            i = index.get(slot.name)
            if i is None:
                continue  # written only by its hook; its source is never read
            raw, padded = (None, None) if slot.axis == "none" else ctx.counts(slot.axis)
            if kinds[i] is None:
                if _missing_is_padding(slot):
                    write(slot.buffer if raw is None else slot.buffer[:padded], slot.pad_value)
                continue
            dst = slot.buffer if raw is None else slot.buffer[:raw]
            _check_source(slot, sources[i], tuple(dst.shape))
            if dst.numel():
                heads, which, _, _ = group(dst, kinds[i])
                heads.append(dst)
                which.append(i)
            copied.append((i, slot, dst.shape))
            tail = _tail_value(slot, self.poison_tails) if raw is not None and raw < padded else None
            if tail is not None:
                write(slot.buffer[raw:padded], tail)
        planned = tuple(_CopyGroup(h + d, tuple(w), c) for h, w, d, c in groups.values())
        plan = _FillPlan(tuple(copied), planned, tuple(fills))
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _constant_like(self, view: torch.Tensor, value: PadValue) -> Optional[torch.Tensor]:
        """A registry-owned tensor like ``view`` full of ``value``; None for a
        view not contiguous or larger than ``_MAX_CONSTANT_NUMEL``."""
        numel = view.numel()
        if not view.is_contiguous() or numel > _MAX_CONSTANT_NUMEL:
            return None
        key = (view.device, view.dtype, _value_key(value))
        constant = self._constants.get(key)
        if constant is None or constant.numel() < numel:
            # Earlier plans keep views of the constant they took.
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

    def _copy_group(self, dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
        # CUDA's _foreach_copy_ has no kernel for some dtypes (uint16/32/64, float8_e8m0fnu); copy_ has.
        try:
            foreach_copy.foreach_copy_(dsts, srcs)
            self.stats.foreach_copies += 1
            return
        except Exception as exc:
            reason = f"foreach copy raised {type(exc).__name__}: {exc}"
        self.stats.per_tensor_fallbacks += 1
        self.stats.last_fallback_reason = reason
        # Warn once per registry: this runs before every replay.
        level = logging.WARNING if self.stats.per_tensor_fallbacks == 1 else logging.DEBUG
        logger.log(level, "registry: copying %d tensors one by one: %s", len(dsts), reason)
        for dst, src in zip(dsts, srcs):
            dst.copy_(src)
