"""``GraphSlot`` (one static graph input), its policies, and ``FillContext``
(one fill's sizes); ``buffer_registry.py`` owns and fills the slots."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch

from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError

AXES = ("bs", "tokens", "none")

ShapeFn = Callable[[int, int], Tuple[int, ...]]
SliceFn = Callable[[torch.Tensor, int, int], torch.Tensor]
SourceFn = Callable[[Any], Optional[torch.Tensor]]
PostFill = Callable[["GraphSlot", Any, "FillContext"], None]
PadValue = Union[bool, int, float]
SizedValue = Callable[["FillContext"], PadValue]


class PaddingPolicy(enum.Enum):
    """What a fill writes into the padded tail ``[raw, padded)`` of a slot."""

    KEEP_PAD = "keep_pad"  # the graph never reads the tail: left as is (poisoned in debug)
    FILL_SENTINEL = "fill_sentinel"  # tail := pad_value (seq_lens fill, dummy KV slot)
    ZERO = "zero"  # tail := 0
    FOREACH_COPY = "foreach_copy"  # head only; the tail holds earlier valid values, never poisoned
    FILL_ONCE = "fill_once"  # a constant: pad_value at registration, never written again


class MissingSource(enum.Enum):
    """What a fill does with a slot whose source is None (an optional field)."""

    ERROR = "error"  # raise: the field is required
    SKIP = "skip"  # leave the slot exactly as it is
    PAD = "pad"  # treat every row as padding: the whole padded view := pad_value


def check_count(name: str, value: object) -> int:
    """An int >= 0 (a size or a count; bools are not counts)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInputError(f"{name}: expected an int >= 0, got {value!r}")
    return value


def canonical_device(device: Union[torch.device, str]) -> torch.device:
    """``cuda`` and ``cuda:<current>`` are one device; give both the same key."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return torch.device("cuda", index)
    return device


@dataclass(frozen=True)
class FillContext:
    """Sizes of one fill: rows ``[:raw]`` come from the batch, ``[raw, padded)``
    are padding. ``pp_proxy_tensors`` is passed to hooks untouched."""

    raw_bs: int
    padded_bs: int
    raw_num_tokens: int
    padded_num_tokens: int
    pp_proxy_tensors: Optional[Any] = None

    def __post_init__(self) -> None:
        for name in ("raw_bs", "padded_bs", "raw_num_tokens", "padded_num_tokens"):
            check_count(f"FillContext.{name}", getattr(self, name))
        if self.raw_bs > self.padded_bs:
            raise InvalidInputError(f"FillContext: expected raw_bs <= padded_bs, got {self.raw_bs} > {self.padded_bs}")
        if self.raw_num_tokens > self.padded_num_tokens:
            raise InvalidInputError(
                f"FillContext: expected raw_num_tokens <= padded_num_tokens, "
                f"got {self.raw_num_tokens} > {self.padded_num_tokens}"
            )

    @classmethod
    def uniform(
        cls, raw_bs: int, padded_bs: int, tokens_per_req: int = 1, pp_proxy_tensors: Any = None
    ) -> "FillContext":
        """Every request, padded ones too, has ``tokens_per_req`` new tokens."""
        n = check_positive_int("tokens_per_req", tokens_per_req)
        raw, padded = check_count("raw_bs", raw_bs), check_count("padded_bs", padded_bs)
        return cls(raw, padded, raw * n, padded * n, pp_proxy_tensors)

    def counts(self, axis: str) -> Tuple[int, int]:
        """``(raw, padded)`` along ``axis`` (``bs`` or ``tokens``)."""
        if axis == "bs":
            return self.raw_bs, self.padded_bs
        if axis == "tokens":
            return self.raw_num_tokens, self.padded_num_tokens
        raise InvalidInputError(f"axis: expected 'bs' or 'tokens', got {axis!r}")


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no truth value to compare by
class GraphSlot:
    """One static graph input: a buffer, padded along dim 0 (``bs`` or ``tokens``).

    ``source_fn(batch)`` overrides the source ``batch.<name>`` (or
    ``batch[name]``); ``slice_fn`` the view a graph is captured on.
    ``copy_from_fb=False``: only ``post_fill``, or ``value_from_sizes(ctx)``
    (an ``axis="none"`` slot), writes it.
    """

    name: str
    shape_fn: Optional[ShapeFn]
    dtype: torch.dtype
    axis: str
    device: Optional[torch.device] = None
    padding_policy: PaddingPolicy = PaddingPolicy.KEEP_PAD
    pad_value: PadValue = 0
    post_fill: Optional[PostFill] = None
    slice_fn: Optional[SliceFn] = None
    source_fn: Optional[SourceFn] = None
    copy_from_fb: bool = True
    buffer: Optional[torch.Tensor] = None
    when_missing: MissingSource = MissingSource.ERROR
    value_from_sizes: Optional[SizedValue] = None

    def __post_init__(self) -> None:
        where = f"slot {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise InvalidInputError(f"slot name: expected a non-empty str, got {self.name!r}")
        if self.axis not in AXES:
            raise InvalidInputError(f"{where}: axis: expected one of {AXES}, got {self.axis!r}")
        for field, kind in (
            ("dtype", torch.dtype),
            ("padding_policy", PaddingPolicy),
            ("when_missing", MissingSource),
            ("pad_value", (bool, int, float)),
        ):
            value = getattr(self, field)
            if not isinstance(value, kind):
                want = "a number" if field == "pad_value" else f"a {kind.__name__}"
                raise InvalidTypeError(f"{where}: {field}: expected {want}, got {value!r}")
        if self.shape_fn is None and self.buffer is None:
            raise InvalidInputError(f"{where}: expected a shape_fn or a buffer to bind, got none")
        if self.device is not None:
            object.__setattr__(self, "device", torch.device(self.device))
        self._check_policy(where)

    def _check_policy(self, where: str) -> None:
        policy = self.padding_policy
        if self.axis == "none" and policy is not PaddingPolicy.KEEP_PAD:
            raise InvalidInputError(
                f"{where}: an axis='none' slot has no padded tail: expected padding_policy KEEP_PAD, got {policy.name}"
            )
        if self.value_from_sizes is not None:
            self._check_value_from_sizes(where)
        if policy is PaddingPolicy.FILL_ONCE and (self.copy_from_fb or self.post_fill is not None):
            raise InvalidInputError(
                f"{where}: a FILL_ONCE slot is a constant: expected copy_from_fb=False and "
                f"no post_fill, got copy_from_fb={self.copy_from_fb}, "
                f"post_fill={self.post_fill!r}"
            )

    def _check_value_from_sizes(self, where: str) -> None:
        if not callable(self.value_from_sizes):
            raise InvalidTypeError(f"{where}: value_from_sizes: expected a callable, got {self.value_from_sizes!r}")
        if self.axis != "none" or self.copy_from_fb or self.post_fill is not None:
            raise InvalidInputError(
                f"{where}: a value_from_sizes slot is written whole from the fill's sizes: expected "
                f"axis='none', copy_from_fb=False and no post_fill, got axis={self.axis!r}, "
                f"copy_from_fb={self.copy_from_fb}, post_fill={self.post_fill!r}"
            )

    def slice_for(self, padded_bs: int, padded_num_tokens: int) -> torch.Tensor:
        """The view a graph of these sizes is captured on; it shares the buffer's storage."""
        buf = self._require_buffer()
        if self.slice_fn is not None:
            return self.slice_fn(buf, padded_bs, padded_num_tokens)
        if self.axis == "none":
            return buf
        rows = padded_bs if self.axis == "bs" else padded_num_tokens
        if not 0 <= rows <= buf.shape[0]:
            raise InvalidInputError(
                f"slot {self.name!r}: expected at most {buf.shape[0]} rows along {self.axis}, got {rows}"
            )
        return buf[:rows]

    def _require_buffer(self) -> torch.Tensor:
        if self.buffer is None:
            raise InvalidInputError(
                f"slot {self.name!r}: expected a registered slot with a buffer, got none; "
                f"use the slot returned by CudaGraphBufferRegistry.register_slot"
            )
        return self.buffer


class SharedBufferPool:
    """Flat buffers shared by key ``(name, numel, dtype, device)``. Build all
    registries before capturing: registration initialises the shared memory."""

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[str, int, torch.dtype, torch.device], torch.Tensor] = {}

    def share_input_buffer(
        self, name: str, numel: int, dtype: torch.dtype, device: Union[torch.device, str]
    ) -> torch.Tensor:
        """The 1-D buffer of ``numel`` elements for this key, zeroed when first created."""
        key = (name, check_count("numel", numel), dtype, canonical_device(device))
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.zeros(numel, dtype=dtype, device=key[3])
            self._buffers[key] = buf
        return buf

    def __len__(self) -> int:
        return len(self._buffers)
