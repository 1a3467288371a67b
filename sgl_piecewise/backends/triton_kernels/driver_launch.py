"""Launching a compiled Triton kernel through the CUDA driver, its arguments
packed once.

Triton's compiled launcher (``CompiledKernel.run``) takes every argument as
a Python object on every call: a Python wrapper allocates the scratch
buffers, then the C launcher parses the whole argument tuple (the decode
kernel has 46 runtime arguments and 12 constexprs) before it calls the
driver. The attention between compiled pieces launches one kernel per layer
with the arguments of the step's first layer but a few pointers (the
layer's own tensors). :class:`DriverLaunch` packs the argument list into the
driver's parameter array once; a launch rewrites those pointers and calls
``cuLaunchKernel`` through ``ctypes``, as Inductor's C++ wrapper launches
Triton kernels.

The packing follows what Triton's launcher passes: the kernel's arguments
that are not constexprs (an integer argument equal to 1 is one: Triton
specialises on it), in signature order, as their C types, then Triton's
scratch pointers (null: only kernels that ask for no scratch are packed). It
is used only where the driver's own record of the kernel's parameters
(``cuFuncGetParamInfo``, CUDA 12.4 and later) agrees with it, parameter by
parameter. Anything else (an argument Triton would reject or truncate, a
kernel with scratch, clusters, a cooperative or PDL launch, tuple or tensor
descriptor arguments, no such driver) packs nothing, and the caller keeps
Triton's launcher.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import torch

from sgl_piecewise.errors import SglPiecewiseError

logger = logging.getLogger("sgl_piecewise.triton")

# Triton's signature types and the C type its launcher packs each into
# (``ty_to_cpp`` and the float packers of Triton's NVIDIA driver); fp16 and
# bf16 scalars are left out (Triton packs them by hand).
_SCALAR_CTYPES = {
    "i1": ctypes.c_int8,
    "i8": ctypes.c_int8,
    "i16": ctypes.c_int16,
    "i32": ctypes.c_int32,
    "i64": ctypes.c_int64,
    "u1": ctypes.c_uint8,
    "u8": ctypes.c_uint8,
    "u16": ctypes.c_uint16,
    "u32": ctypes.c_uint32,
    "u64": ctypes.c_uint64,
    "fp32": ctypes.c_float,
    "f32": ctypes.c_float,
    "fp64": ctypes.c_double,
}
_POINTER = ctypes.c_uint64  # CUdeviceptr
# Triton appends at most two scratch pointers (global, then profile).
_MAX_SCRATCH = 2
_CUDA_ERROR_INVALID_VALUE = 1


class DriverLaunchError(SglPiecewiseError, RuntimeError):
    """The CUDA driver refused a launch."""


@dataclass(frozen=True)
class ParamLayout:
    """How a launch's arguments become the kernel's parameters."""

    arg_positions: Tuple[int, ...]  # the arguments that are parameters, in order
    ctypes: Tuple[type, ...]  # each one's C type
    num_scratch: int = 0  # null pointers after them


def param_layout(signature: Sequence[Any], num_args: int) -> Optional[ParamLayout]:
    """The parameters Triton's launcher packs from a launch of ``num_args``
    runtime arguments, given the compiled kernel's signature types (one per
    kernel argument, in order; ``"constexpr"`` for constants). None where
    this module does not pack them the same way."""
    if num_args > len(signature) or any(ty != "constexpr" for ty in signature[num_args:]):
        return None  # a runtime argument the launch does not give
    positions, types = [], []
    for i, ty in enumerate(signature[:num_args]):
        if ty == "constexpr":
            continue
        if not isinstance(ty, str):
            return None  # a tuple argument
        ctype = _POINTER if ty.startswith("*") else _SCALAR_CTYPES.get(ty)
        if ctype is None:
            return None  # a tensor descriptor, an fp16/bf16 scalar
        positions.append(i)
        types.append(ctype)
    return ParamLayout(tuple(positions), tuple(types))


def packed_value(ctype: type, value: Any) -> Optional[Any]:
    """``value`` as the C ``ctype`` Triton's launcher would pass, or None
    where it would raise or truncate (ctypes alone truncates silently)."""
    if ctype in (ctypes.c_float, ctypes.c_double):
        return ctype(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if not isinstance(value, int):
        return None
    packed = ctype(value)
    return packed if packed.value == value else None


class _Driver:
    """The two entry points of ``libcuda`` this module calls."""

    def __init__(self, lib: ctypes.CDLL):
        self.launch = lib.cuLaunchKernel
        self.launch.restype = ctypes.c_int
        self.launch.argtypes = [
            ctypes.c_void_p,
            *[ctypes.c_uint] * 7,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        self.param_info = lib.cuFuncGetParamInfo
        self.param_info.restype = ctypes.c_int
        self.param_info.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p]
        self.error_name = lib.cuGetErrorName
        self.error_name.restype = ctypes.c_int
        self.error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def params(self, function: int, most: int) -> Optional[Tuple[int, ...]]:
        """The size of each of the kernel's parameters, or None when the
        driver cannot say or the kernel has more than ``most``."""
        offset, size, sizes = ctypes.c_size_t(), ctypes.c_size_t(), []
        for index in range(most + 1):
            err = self.param_info(function, index, ctypes.byref(offset), ctypes.byref(size))
            if err == _CUDA_ERROR_INVALID_VALUE:  # past the last parameter
                return tuple(sizes)
            if err:
                return None
            sizes.append(size.value)
        return None

    def describe(self, err: int) -> str:
        name = ctypes.c_char_p()
        if self.error_name(err, ctypes.byref(name)) or name.value is None:
            return f"CUDA error {err}"
        return name.value.decode()


@functools.lru_cache(maxsize=1)
def _driver() -> Optional[_Driver]:
    try:
        return _Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError) as exc:  # no driver, or one before cuFuncGetParamInfo (CUDA 12.4)
        logger.debug("launching Triton kernels through Triton's launcher: %s", exc)
        return None


def kernel_layout(kernel: Any, num_args: int) -> Optional[ParamLayout]:
    """The :class:`ParamLayout` of a Triton ``CompiledKernel`` launched with
    ``num_args`` runtime arguments, checked against the driver's record of
    its parameters; None where it cannot be packed here."""
    driver = _driver()
    meta = getattr(kernel, "metadata", None)
    signature = getattr(getattr(kernel, "src", None), "signature", None)
    if driver is None or meta is None or not isinstance(signature, dict) or not kernel.function:
        return None
    plain = (
        getattr(meta, "num_ctas", 1) == 1
        and not getattr(meta, "launch_cooperative_grid", False)
        and not getattr(meta, "launch_pdl", False)
        and not getattr(meta, "global_scratch_size", 0)
        and not getattr(meta, "profile_scratch_size", 0)
    )
    layout = param_layout(list(signature.values()), num_args) if plain else None
    if layout is None:
        return None
    sizes = driver.params(kernel.function, len(layout.ctypes) + _MAX_SCRATCH)
    if sizes is None or len(sizes) < len(layout.ctypes):
        return None
    scratch = sizes[len(layout.ctypes) :]
    packed = tuple(ctypes.sizeof(t) for t in layout.ctypes) + (ctypes.sizeof(_POINTER),) * len(scratch)
    if sizes != packed:
        return None
    return ParamLayout(layout.arg_positions, layout.ctypes, len(scratch))


class DriverLaunch:
    """One kernel, grid and argument list packed for ``cuLaunchKernel``;
    ``launch(pointers)`` rewrites the pointer arguments at ``changing``
    positions and launches on the current stream.

    Args:
        kernel: the compiled kernel (Triton's ``CompiledKernel``, loaded).
        layout: its :func:`kernel_layout` for ``args``.
        grid: up to three grid dimensions.
        args: every runtime argument, pointers as device addresses (ints).
        changing: positions in ``args`` of the pointers a launch gives anew.

    Build it with :func:`prepare`, which returns None where an argument
    would not pack as Triton packs it.
    """

    def __init__(self, kernel: Any, layout: ParamLayout, grid: Sequence[int], args: Sequence[Any],
                 changing: Sequence[int]):  # fmt: skip
        values = [packed_value(t, args[i]) for i, t in zip(layout.arg_positions, layout.ctypes)]
        if any(v is None for v in values):
            raise ValueError("an argument does not pack as Triton's launcher packs it")
        where = {pos: values[n] for n, pos in enumerate(layout.arg_positions)}
        if any(not isinstance(where.get(i), _POINTER) for i in changing):
            raise ValueError("a changing argument is not a pointer parameter")
        self._values = values + [_POINTER(0) for _ in range(layout.num_scratch)]  # kept alive: the array points at them
        self._params = (ctypes.c_void_p * len(self._values))(*map(ctypes.addressof, self._values))
        self._changing = tuple(where[i] for i in changing)
        grid = tuple(grid) + (1,) * (3 - len(grid))
        meta = kernel.metadata
        self._head = (kernel.function, *grid, 32 * meta.num_warps, 1, 1, meta.shared)
        self._name = meta.name
        self._driver = _driver()

    def launch(self, pointers: Sequence[int]) -> None:
        for slot, pointer in zip(self._changing, pointers):
            slot.value = pointer
        stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
        err = self._driver.launch(*self._head, stream, self._params, None)
        if err:
            raise DriverLaunchError(f"cuLaunchKernel of {self._name}: {self._driver.describe(err)}")


def prepare(kernel: Any, layout: Optional[ParamLayout], grid: Sequence[int], args: Sequence[Any],
            changing: Sequence[int]) -> Optional[DriverLaunch]:  # fmt: skip
    """A :class:`DriverLaunch`, or None where ``layout`` is None or an
    argument would not pack as Triton's launcher packs it."""
    if layout is None or not 1 <= len(grid) <= 3:
        return None
    try:
        return DriverLaunch(kernel, layout, grid, args, changing)
    except ValueError as exc:
        logger.debug("launching %s through Triton's launcher: %s", getattr(kernel, "name", kernel), exc)
        return None
