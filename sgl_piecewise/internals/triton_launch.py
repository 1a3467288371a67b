"""A Triton launcher that skips ``JITFunction.run``'s per-call Python and
calls the compiled kernel's own launcher (``JITFunction.warmup``,
``CompiledKernel``, ``triton.knobs`` hooks, torch's raw stream getters);
torch 2.11-2.13, Triton 3.4-3.6. Why: a launch per layer sits on the host's
critical path. Fallback: ``kernel[grid](*args, **meta)``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import threading
import weakref
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger("sgl_piecewise.triton")

TORCH_VERSIONS = ("2.11", "2.13")
TRITON_VERSIONS = ("3.4", "3.6")  # written against; others are only checked for what is used

# JITFunction.run's launch, whitespace removed: BoundKernel makes the same call.
_RUN_LAUNCH = (
    "kernel.run(grid_0,grid_1,grid_2,stream,kernel.function,kernel.packed_metadata,launch_metadata,"
    "knobs.runtime.launch_enter_hook,knobs.runtime.launch_exit_hook,"
)


def _check_triton() -> Tuple[Any, Any, str]:
    try:
        from triton.compiler import CompiledKernel
        from triton.runtime.jit import JITFunction
    except ImportError as exc:
        return None, None, f"Triton's JITFunction or CompiledKernel does not import ({exc})"
    try:
        from triton import knobs
    except ImportError:
        return None, None, "triton.knobs is missing (Triton < 3.4): the launch hooks live elsewhere"
    runtime = getattr(knobs, "runtime", None)
    missing = [h for h in ("launch_enter_hook", "launch_exit_hook") if not hasattr(runtime, h)]
    if missing:
        return None, None, f"triton.knobs.runtime has no {', '.join(missing)}"
    warmup = getattr(JITFunction, "warmup", None)
    if not callable(warmup) or "grid" not in inspect.signature(warmup).parameters:
        return None, None, "JITFunction has no warmup(*args, grid=..., **kwargs)"
    if not callable(getattr(CompiledKernel, "launch_metadata", None)):
        return None, None, "CompiledKernel has no launch_metadata(grid, stream, *args)"
    try:
        source = inspect.getsource(JITFunction.run)
    except (OSError, TypeError) as exc:
        return None, None, f"JITFunction.run's source is not readable ({exc})"
    if _RUN_LAUNCH not in re.sub(r"\s+", "", source):
        return (
            None,
            None,
            (
                "JITFunction.run no longer launches as kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, "
                "kernel.packed_metadata, launch_metadata, enter_hook, exit_hook, *args)"
            ),
        )
    return knobs, JITFunction, ""


_knobs, _JITFunction, UNAVAILABLE_REASON = _check_triton()
AVAILABLE: bool = _knobs is not None
if not AVAILABLE:
    logger.info("Triton kernels launch through kernel[grid] (the fast launcher is off: %s)", UNAVAILABLE_REASON)

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_raw_device = getattr(torch._C, "_cuda_getDevice", None)
RAW_STREAM: bool = callable(_raw_stream) and callable(_raw_device)


def _public_current_stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _public_current_device() -> int:
    return torch.cuda.current_device()


if RAW_STREAM:

    def current_stream() -> int:
        return _raw_stream(_raw_device())

    current_device = _raw_device
else:
    current_stream = _public_current_stream
    current_device = _public_current_device


Meta = Dict[str, Any]

# Compiles ahead run on a few threads (mostly native code, outside the GIL).
_COMPILE_AHEAD_THREADS = 3
_compile_ahead_pool: Optional[ThreadPoolExecutor] = None


def _compile_pool() -> ThreadPoolExecutor:
    global _compile_ahead_pool
    if _compile_ahead_pool is None:
        _compile_ahead_pool = ThreadPoolExecutor(_COMPILE_AHEAD_THREADS, thread_name_prefix="sgl-piecewise-compile")
        # At exit, drop the compiles not started yet.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(lambda pool=_compile_ahead_pool: pool.shutdown(wait=False, cancel_futures=True))
    return _compile_ahead_pool


def _arg_key(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    return arg  # ints and floats by value: Triton specialises some ints on theirs


def _active(hook: Any) -> Any:
    return None if hook is None or getattr(hook, "calls", True) == [] else hook


class BoundKernel:
    """One compiled kernel with its constexprs: ``bound(grid, *args)``
    launches it through its own launcher. Pointers may be given as device
    addresses; launch hooks are called as ``JITFunction.run`` calls them,
    empty hook chains skipped."""

    def __init__(self, kernel: Any, constexprs: Tuple):
        self.kernel, self.constexprs = kernel, constexprs

    def __call__(self, grid: Sequence[int], *args: Any) -> None:
        stream = current_stream()
        runtime = _knobs.runtime
        enter, leave = _active(runtime.launch_enter_hook), _active(runtime.launch_exit_hook)
        kernel = self.kernel
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        hooked = enter is not None or leave is not None
        launch_metadata = kernel.launch_metadata(grid, stream, *args, *self.constexprs) if hooked else None
        # kernel.run is read first: it loads the kernel, which sets kernel.function.
        kernel.run(
            grid[0],
            grid_1,
            grid_2,
            stream,
            kernel.function,
            kernel.packed_metadata,
            launch_metadata,
            enter,
            leave,
            *args,
            *self.constexprs,
        )


class FastLauncher:
    """Launches a kernel as ``kernel[grid](*args, **meta)`` does, one compiled
    kernel kept per specialisation (integers by value, tensors by dtype and
    alignment); ``variants(meta)``: launch settings compiled ahead."""

    def __init__(self, fn: Any, variants: Optional[Callable[[Meta], List[Meta]]] = None):
        self.fn = fn
        # False for good: an interpreted kernel, or a launcher that refused its arguments.
        self.fast = _JITFunction is not None and isinstance(fn, _JITFunction)
        self._kernels: Dict[Tuple, BoundKernel] = {}
        self.variants = variants
        self._ahead: Dict[Tuple, Future] = {}

    max_entries = 1024

    def __call__(self, grid: Sequence[int], *args: Any, **meta: Any) -> None:
        if not (self.fast and AVAILABLE):
            self.fn[grid](*args, **meta)
            return
        key = self._key(args, meta)
        bound = self._kernels.get(key)
        if bound is None:
            self._first_launch(key, grid, args, meta)
            return
        try:
            bound(grid, *args)
        except TypeError:  # raised before it launches anything
            self.fast = False
            self.fn[grid](*args, **meta)

    def bound(self, args: Sequence[Any], meta: Dict[str, Any]) -> Optional[BoundKernel]:
        """The compiled kernel launches with ``args`` and ``meta`` took, if any."""
        return self._kernels.get(self._key(args, meta)) if self.fast and AVAILABLE else None

    def _key(self, args: Sequence[Any], meta: Dict[str, Any]) -> Tuple:
        return current_device(), tuple(map(_arg_key, args)), tuple(meta.items())

    def _first_launch(self, key: Tuple, grid: Sequence[int], args: Sequence[Any], meta: Dict[str, Any]) -> None:
        ahead = self._ahead.pop(key, None)
        if ahead is not None:
            with contextlib.suppress(CancelledError):  # cancelled only while the interpreter exits
                ahead.result()
        kernel = self.fn.warmup(*args, grid=grid, **meta)
        constexprs = self._constexpr_values(len(args), meta)
        if constexprs is None or kernel is None or not hasattr(kernel, "packed_metadata"):
            self.fast = False
            self.fn[grid](*args, **meta)
            return
        if len(self._kernels) >= self.max_entries:
            self._kernels.clear()
        bound = BoundKernel(kernel, constexprs)
        self._kernels[key] = bound
        try:
            bound(grid, *args)
        except TypeError:  # as in __call__: it launched nothing
            self.fast = False
            self._kernels.clear()
            self.fn[grid](*args, **meta)
            return
        if self.variants is not None:
            self._compile_ahead(args, meta)

    def _compile_ahead(self, args: Sequence[Any], meta: Meta) -> None:
        """Compile this launch's kernel under each of ``self.variants(meta)``
        in the background, tensors handed as dtypes (aligned ones only)."""
        if any(isinstance(a, torch.Tensor) and a.data_ptr() % 16 for a in args):
            return
        stand_ins = [a.dtype if isinstance(a, torch.Tensor) else a for a in args]
        device = current_device()
        if len(self._ahead) >= self.max_entries:
            self._ahead.clear()
        for other in self.variants(meta):
            key = self._key(args, other)
            if key in self._kernels or key in self._ahead:
                continue
            try:
                self._ahead[key] = _compile_pool().submit(self._compile, device, stand_ins, other)
            except RuntimeError:  # the pool was shut down: the interpreter is exiting
                return

    def _compile(self, device: int, stand_ins: List[Any], meta: Meta) -> None:
        try:
            torch.cuda.set_device(device)
            self.fn.warmup(*stand_ins, grid=(1,), **meta)
        except Exception as exc:  # never let a guess break a launch
            logger.debug("compiling %s ahead for %s failed: %s", getattr(self.fn, "__name__", self.fn), meta, exc)

    def _constexpr_values(self, num_args: int, meta: Dict[str, Any]) -> Optional[Tuple]:
        names = self.fn.arg_names[num_args:]
        if any(name not in meta for name in names):
            return None
        return tuple(meta[name] for name in names)


class StepLaunch:
    """One kernel launched per layer of a step, each layer's tensors at
    ``layer_positions``: after the first launch through the compiled kernel,
    pointers as addresses; a launch given its ``layer`` is kept for
    :meth:`launch_again`."""

    def __init__(
        self,
        launcher: FastLauncher,
        grid: Tuple[int, ...],
        args: Sequence[Any],
        meta: Dict[str, Any],
        layer_positions: Tuple[int, ...],
    ):
        self.launcher, self.grid, self.meta = launcher, grid, meta
        self.layer_positions = layer_positions
        # The first layer's tensors are not kept: they would stay allocated.
        self._args = [None if i in layer_positions else a for i, a in enumerate(args)]
        self._addresses: Optional[List[Any]] = None
        self._kernel: Optional[BoundKernel] = None
        self._bindable = True
        # layer -> (weak refs to its tensors, their addresses, its argument tuple)
        self._layers: Dict[int, Tuple[tuple, tuple, tuple]] = {}

    def launch_again(self, layer: int, *layer_tensors: torch.Tensor) -> bool:
        """Launch ``layer`` as last time if handed the same tensors at the
        same addresses; else False, launching nothing."""
        kept = self.kept_launch(layer, layer_tensors)
        if kept is None:
            return False
        self.launch_kept(kept)
        return True

    def kept_launch(self, layer: int, layer_tensors: Sequence[torch.Tensor]) -> Optional[tuple]:
        entry = self._layers.get(layer)
        if entry is None:
            return None
        refs, ptrs, kept = entry
        for ref, tensor in zip(refs, layer_tensors):
            if ref() is not tensor:
                return None
        return kept if tuple(map(_data_ptr, layer_tensors)) == ptrs else None

    def launch_kept(self, kept: tuple) -> None:
        self._kernel(self.grid, *kept)

    def launch(self, *layer_tensors: torch.Tensor, layer: Optional[int] = None) -> None:
        if self._kernel is not None:
            ptrs = [t.data_ptr() for t in layer_tensors]
            if not any(p & 15 for p in ptrs):
                args = self._addresses.copy()
                for i, p in zip(self.layer_positions, ptrs):
                    args[i] = p
                try:
                    self._kernel(self.grid, *args)
                except TypeError:  # a launcher that takes no addresses launched nothing
                    self._bindable, self._kernel = False, None
                    self._layers.clear()
                else:
                    if layer is not None:
                        self._keep(layer, layer_tensors, ptrs, args)
                    return
        args = self._args.copy()
        for i, t in zip(self.layer_positions, layer_tensors):
            args[i] = t
        self.launcher(self.grid, *args, **self.meta)
        if self._bindable and self._kernel is None:
            self._bind(args, layer_tensors)

    def rebind(self, position: int, tensor: torch.Tensor) -> bool:
        """Put ``tensor`` at argument ``position`` from now on; False, changing
        nothing, where its 16-byte alignment differs from the old one's."""
        old = self._args[position]
        if (old.data_ptr() % 16 == 0) != (tensor.data_ptr() % 16 == 0):
            return False
        self._args[position] = tensor
        if self._addresses is not None and self._addresses[position] != tensor.data_ptr():
            self._addresses[position] = tensor.data_ptr()
            self._layers.clear()
        return True

    def _keep(self, layer: int, layer_tensors: Sequence[torch.Tensor], ptrs: List[int], args: List[Any]) -> None:
        if len(self._layers) >= _MAX_KEPT_LAYERS:
            self._layers.clear()
        self._layers[layer] = (tuple(map(weakref.ref, layer_tensors)), tuple(ptrs), tuple(args))

    def _bind(self, args: List[Any], layer_tensors: Sequence[torch.Tensor]) -> None:
        kernel = self.launcher.bound(args, self.meta)
        if kernel is not None and all(t.data_ptr() % 16 == 0 for t in layer_tensors):
            self._kernel = kernel
            self._addresses = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]


_data_ptr = torch.Tensor.data_ptr
_MAX_KEPT_LAYERS = 1024
