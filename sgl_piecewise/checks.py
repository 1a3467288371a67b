"""One checker for tensor arguments, so every message reads the same way:
``<name>: expected <what>, got <what>``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from sgl_piecewise.errors import InvalidInputError, InvalidTypeError

# A shape spec entry is an exact size, or None for "any size".
ShapeSpec = Sequence[Optional[int]]


def _fmt_shape(spec: ShapeSpec) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in spec) + "]"


def _shape_matches(name: str, spec: ShapeSpec, sizes: Sequence[int]) -> bool:
    """Each size equals ``spec``'s where it names one. Traced sizes are
    asserted equal, not compared: two token counts marked unbacked (a first
    call of one token) are separate symbols, and comparing them would guard
    on data. Plain sizes are compared first: this runs on every step."""
    if len(sizes) != len(spec):
        return False
    for want, got in zip(spec, sizes):
        if want is None or (type(want) is int and type(got) is int and want == got):
            continue
        if isinstance(want, torch.SymInt) or isinstance(got, torch.SymInt):
            torch._check(want == got, lambda: _shape_message(name, spec, sizes))
        elif want != got:
            return False
    return True


def _shape_message(name: str, spec: ShapeSpec, sizes: Sequence[int]) -> str:
    return f"{name}: expected shape {_fmt_shape(spec)}, got {list(sizes)}"


def check_tensor(
    name: str,
    value: object,
    *,
    shape: Optional[ShapeSpec] = None,
    dtype: Union[torch.dtype, Sequence[torch.dtype], None] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Validate ``value`` and return it; raise with an actionable message."""
    if not isinstance(value, torch.Tensor):
        raise InvalidTypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if shape is not None:
        if not _shape_matches(name, shape, value.shape):
            raise InvalidInputError(_shape_message(name, shape, value.shape))
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if value.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise InvalidInputError(f"{name}: expected dtype {want}, got {value.dtype}")
    if device is not None and not same_device(value.device, device):
        raise InvalidInputError(f"{name}: expected device {device}, got {value.device}")
    return value


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` name the same device when 0 is current."""
    if a == b:  # the common case, answered without asking CUDA for the current device
        return True
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cuda":
        current = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index or a.index is None or b.index is None


def check_positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidInputError(f"{name}: expected a positive int, got {value!r}")
    return value


def check_float_dtype(name: str, dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidTypeError(f"{name}: expected a floating torch.dtype, got {dtype!r}")
    return dtype
