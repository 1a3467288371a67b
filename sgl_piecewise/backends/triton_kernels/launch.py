"""A launcher for our Triton kernels that skips Triton's per-call Python.

``kernel[grid](*args, **meta)`` goes through ``JITFunction.run``: it binds
the arguments to the signature, computes their specialisation (dtypes,
16-byte alignment of pointers, integers equal to 1 or divisible by 16),
looks the compiled kernel up, builds launch metadata for the launch hooks
and only then launches it. The attention between compiled pieces launches
one of our kernels per layer per step; on the H200 host measured
(docs/BENCHMARKS.md, "Where the attention's host time goes") this launcher
took an empty kernel's launch from 18 to 14 µs, and a :class:`BoundKernel`
given device addresses as integers to 6 µs: Triton's launcher then neither
calls ``data_ptr()`` nor asks the driver about each pointer.

:class:`FastLauncher` launches the first call of each specialisation through
``JITFunction.run`` and keeps the compiled kernel it returns; later calls
with the same specialisation key launch that kernel directly through its
own launcher. The key is computed here, more finely than Triton's (every
integer and float by value, every tensor by dtype and 16-byte alignment,
the device), so a reused kernel was always compiled for arguments like the
ones it gets. :meth:`FastLauncher.bound` hands that kernel to a caller that
launches it many times with arguments of one specialisation
(``decode.DecodePlan``, and :class:`StepLaunch` for the extend steps).

Anything unexpected (the Triton interpreter, a Triton whose compiled-kernel
launcher takes other arguments) falls back to ``kernel[grid](...)`` for good.
Launch hooks (a profiler's) are called as ``JITFunction.run`` calls them;
Triton's default empty hook chains are skipped.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from triton.runtime.jit import JITFunction

try:  # the launch hooks' home since Triton 3.4
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: always the slow path
    _knobs = None


def _arg_key(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    return arg  # ints and floats by value: Triton specialises some ints on theirs


def _active(hook: Any) -> Any:
    """``hook``, or None when it is None or an empty ``knobs.HookChain``."""
    return None if hook is None or getattr(hook, "calls", True) == [] else hook


class BoundKernel:
    """One compiled kernel with its constexprs: ``bound(grid, *args)`` is a
    launch through the kernel's own compiled launcher and nothing else.
    Pointer arguments may be given as integers (device addresses): the
    launcher then skips both the ``data_ptr()`` call and its pointer query
    per argument. Launch hooks (a profiler's) are called as
    ``JITFunction.run`` calls them; Triton's default empty hook chains are
    skipped: building the launch metadata for them and calling them cost
    more than the rest of the launch."""

    def __init__(self, kernel: Any, constexprs: Tuple):
        self.kernel, self.constexprs = kernel, constexprs

    def __call__(self, grid: Sequence[int], *args: Any) -> None:
        kernel = self.kernel
        stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        enter, leave = _active(_knobs.runtime.launch_enter_hook), _active(_knobs.runtime.launch_exit_hook)
        hooked = enter is not None or leave is not None
        launch_metadata = kernel.launch_metadata(grid, stream, *args, *self.constexprs) if hooked else None
        kernel.run(grid[0], grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,
                   enter, leave, *args, *self.constexprs)  # fmt: skip


class FastLauncher:
    """Launches one ``@triton.jit`` kernel as ``kernel[grid](*args, **meta)``
    does, without ``JITFunction.run`` after the first call of each
    specialisation. ``args`` are the kernel's runtime arguments in signature
    order; ``meta`` holds every constexpr argument (by name) and the launch
    options (``num_warps``, ``num_stages``)."""

    def __init__(self, fn: Any):
        self.fn = fn
        self.fast = isinstance(fn, JITFunction) and _knobs is not None
        self._kernels: Dict[Tuple, BoundKernel] = {}

    # Keys hold integers by value; a long run of ever new values (say, a
    # token count) must not grow the table without bound.
    max_entries = 1024

    def __call__(self, grid: Sequence[int], *args: Any, **meta: Any) -> None:
        if not self.fast:
            self.fn[grid](*args, **meta)
            return
        key = self._key(args, meta)
        bound = self._kernels.get(key)
        if bound is None:
            self._first_launch(key, grid, args, meta)
            return
        try:
            bound(grid, *args)
        except TypeError:  # the compiled launcher parses its arguments before it launches anything
            self.fast = False
            self.fn[grid](*args, **meta)

    def bound(self, args: Sequence[Any], meta: Dict[str, Any]) -> Optional[BoundKernel]:
        """The compiled kernel that launches with ``args`` and ``meta`` took
        (None before the first such launch, or on the slow path): for a
        caller that launches it many times with arguments of the same
        specialisation (the same dtypes, alignments and integer values)."""
        return self._kernels.get(self._key(args, meta)) if self.fast else None

    def _key(self, args: Sequence[Any], meta: Dict[str, Any]) -> Tuple:
        return torch._C._cuda_getDevice(), tuple(map(_arg_key, args)), tuple(meta.items())

    def _first_launch(self, key: Tuple, grid: Sequence[int], args: Sequence[Any], meta: Dict[str, Any]) -> None:
        kernel = self.fn[grid](*args, **meta)
        constexprs = self._constexpr_values(len(args), meta)
        usable = constexprs is not None and kernel is not None and hasattr(kernel, "packed_metadata")
        if usable:
            if len(self._kernels) >= self.max_entries:
                self._kernels.clear()
            self._kernels[key] = BoundKernel(kernel, constexprs)
        else:
            self.fast = False

    def _constexpr_values(self, num_args: int, meta: Dict[str, Any]) -> Optional[Tuple]:
        """The values of the parameters after the runtime arguments, in
        signature order, as the compiled launcher takes them; None when a
        parameter is missing (a default this launcher does not fill in)."""
        names = self.fn.arg_names[num_args:]
        if any(name not in meta for name in names):
            return None
        return tuple(meta[name] for name in names)


class StepLaunch:
    """One kernel launched once per layer of a step with the same arguments
    but a layer's own tensors (at ``layer_positions`` of ``args``).

    The first launch goes through the ``FastLauncher``; later ones through
    its compiled kernel with every pointer given as a device address, while
    the layer's tensors are 16-byte aligned as the first layer's were (the
    kernel was compiled for that), else through the launcher again. The
    caller compares a layer's shapes, strides and dtypes with the first's.
    """

    def __init__(self, launcher: FastLauncher, grid: Tuple[int, ...], args: Sequence[Any],
                 meta: Dict[str, Any], layer_positions: Tuple[int, ...]):  # fmt: skip
        self.launcher, self.grid, self.meta = launcher, grid, meta
        self.layer_positions = layer_positions
        # Not the first layer's own tensors: a plan outlives its first layer,
        # and a tensor it kept alive would stay allocated (inside a graph
        # pool, torch's cudagraph trees refuse to record past one).
        self._args = [None if i in layer_positions else a for i, a in enumerate(args)]
        self._addresses: Optional[List[Any]] = None  # after the first launch: every pointer as an int
        self._kernel: Optional[BoundKernel] = None
        self._bindable = True

    def launch(self, *layer_tensors: torch.Tensor) -> None:
        if self._kernel is not None:
            ptrs = [t.data_ptr() for t in layer_tensors]
            if not any(p & 15 for p in ptrs):
                args = self._addresses.copy()
                for i, p in zip(self.layer_positions, ptrs):
                    args[i] = p
                try:
                    self._kernel(self.grid, *args)
                    return
                except TypeError:  # a launcher that takes no addresses: it parsed, launched nothing
                    self._bindable, self._kernel = False, None
        args = self._args.copy()
        for i, t in zip(self.layer_positions, layer_tensors):
            args[i] = t
        self.launcher(self.grid, *args, **self.meta)
        if self._bindable and self._kernel is None:
            self._bind(args, layer_tensors)

    def _bind(self, args: List[Any], layer_tensors: Sequence[torch.Tensor]) -> None:
        kernel = self.launcher.bound(args, self.meta)
        if kernel is not None and all(t.data_ptr() % 16 == 0 for t in layer_tensors):
            self._kernel = kernel
            self._addresses = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
