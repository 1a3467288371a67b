"""A launcher for our Triton kernels that skips Triton's per-call Python.

What it bypasses: ``kernel[grid](*args, **meta)`` goes through
``JITFunction.run``, which binds the arguments to the signature, computes
their specialisation (dtypes, 16-byte alignment of pointers, integers equal
to 1 or divisible by 16), looks the compiled kernel up, builds launch
metadata for the launch hooks and only then launches it. This module calls
the compiled kernel's own Triton launcher directly instead.

Why: the piecewise step launches one attention kernel per layer between
compiled graphs, on the host's critical path. On the H200 host measured
(docs/BENCHMARKS.md, "Where the attention's host time goes") an empty
kernel's launch took 18 µs through ``kernel[grid]`` and 6 µs through a
:class:`BoundKernel` given device addresses as integers (Triton's launcher
then neither calls ``data_ptr()`` nor asks the driver about each pointer).

Private APIs it uses, written against torch 2.11-2.13 and Triton 3.4-3.6
(checked against the 3.4.0, 3.6.0 and 3.9.0 sources):

- ``triton.runtime.jit.JITFunction``: ``warmup(*args, grid=, **meta)``
  (compiles or finds a specialisation's kernel, launches nothing),
  ``arg_names``; whether a kernel is one (an interpreted one launches through
  ``kernel[grid]``);
- the compiled kernel (``triton.compiler.CompiledKernel``): its launcher
  ``run(grid_0, grid_1, grid_2, stream, function, packed_metadata,
  launch_metadata, enter_hook, exit_hook, *args)`` as ``JITFunction.run``
  calls it, ``function``, ``packed_metadata``, ``launch_metadata(grid,
  stream, *args)``;
- ``triton.knobs.runtime.launch_enter_hook`` / ``launch_exit_hook`` (None or
  a callable on 3.4, a ``HookChain`` on 3.6 and 3.9);
- ``torch._C._cuda_getCurrentRawStream`` and ``torch._C._cuda_getDevice``
  (:func:`current_stream`, :func:`current_device`): the public
  ``torch.cuda.current_stream().cuda_stream`` builds a ``Stream`` object a
  launch, 4.7 µs against 0.3 µs (``torch.cuda.current_device()``: 0.34
  against 0.15 µs); with both public, a bound launch by address took 17
  instead of 8 µs (H200 host, torch 2.11, Triton 3.6, 2026-11-28; there
  ``kernel[grid]`` took 15-19 µs). See :data:`RAW_STREAM`.

Checked at import: :data:`AVAILABLE` is False, with :data:`UNAVAILABLE_REASON` saying
why, when any of the Triton ones is missing or ``JITFunction.run`` no longer
calls the launcher as above; then every launch takes the public path,
``kernel[grid](*args, **meta)`` (the path a launcher also takes for good
when a kernel runs under Triton's interpreter, or when a compiled launcher
refuses its arguments). ``AVAILABLE`` is read at every launch, so a test
sets it to False to force that path. Without the torch ones
(:data:`RAW_STREAM` False) the stream and device come from the public
``torch.cuda`` calls.

:class:`FastLauncher` compiles (or finds) the kernel of the first call of
each specialisation through ``JITFunction.warmup`` and keeps it; every call
with the same specialisation key, the first included, launches that kernel
through its own Triton launcher. The key is computed here, more finely than
Triton's (every integer and float by value, every tensor by dtype and
16-byte alignment, the device), so a reused kernel was always compiled for
arguments like the ones it gets. :meth:`FastLauncher.bound` hands that
kernel to a caller that launches it many times with arguments of one
specialisation (:class:`StepLaunch`, for the decode and extend steps).
Launch hooks (a profiler's) are called as ``JITFunction.run`` calls them;
Triton's default empty hook chains are skipped.

A launcher given ``variants`` compiles ahead: after the first launch of a
specialisation it compiles, on a background thread, the kernels of the same
arguments under the other launch settings ``variants(meta)`` names (the
extend kernel's smaller row tiles, which shorter queries take). Triton's
compiler spends most of its time outside the GIL (MLIR and LLVM passes,
``ptxas``), so a start-up that would compile them one after the other, each
in the middle of its work, finds them compiled; a first launch of one that
is still compiling waits for it instead of compiling it again.
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

# Written against these; versions outside them are not refused, only
# checked for what this module uses (AVAILABLE).
TORCH_VERSIONS = ("2.11", "2.13")
TRITON_VERSIONS = ("3.4", "3.6")

# JITFunction.run's launch, whitespace removed: the call BoundKernel makes.
_RUN_LAUNCH = (
    "kernel.run(grid_0,grid_1,grid_2,stream,kernel.function,kernel.packed_metadata,launch_metadata,"
    "knobs.runtime.launch_enter_hook,knobs.runtime.launch_exit_hook,"
)


def _check_triton() -> Tuple[Any, Any, str]:
    """(``triton.knobs`` and ``JITFunction`` where every Triton internal this
    module uses is there, else Nones; why not, '' when it is)."""
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
# Whether launches may skip JITFunction.run; read at every launch.
AVAILABLE: bool = _knobs is not None
if not AVAILABLE:
    logger.info("Triton kernels launch through kernel[grid] (the fast launcher is off: %s)", UNAVAILABLE_REASON)

# torch's raw current-stream and device getters (see the module docstring).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_raw_device = getattr(torch._C, "_cuda_getDevice", None)
RAW_STREAM: bool = callable(_raw_stream) and callable(_raw_device)


def _public_current_stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _public_current_device() -> int:
    return torch.cuda.current_device()


if RAW_STREAM:

    def current_stream() -> int:
        """The current CUDA stream of the current device, as an integer handle."""
        return _raw_stream(_raw_device())

    current_device = _raw_device
else:
    current_stream = _public_current_stream
    current_device = _public_current_device


Meta = Dict[str, Any]

# Background compiles: a few threads (each compile is mostly single-threaded
# native code), started on first use.
_COMPILE_AHEAD_THREADS = 3
_compile_ahead_pool: Optional[ThreadPoolExecutor] = None


def _compile_pool() -> ThreadPoolExecutor:
    global _compile_ahead_pool
    if _compile_ahead_pool is None:
        _compile_ahead_pool = ThreadPoolExecutor(_COMPILE_AHEAD_THREADS, thread_name_prefix="sgl-piecewise-compile")
        # At exit, drop the compiles not started yet rather than wait for
        # them; a compile under way finishes (Triton's cache writes are
        # atomic either way). Registered after concurrent.futures' own
        # hook, so it runs before that joins the threads.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(lambda pool=_compile_ahead_pool: pool.shutdown(wait=False, cancel_futures=True))
    return _compile_ahead_pool


def _arg_key(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    return arg  # ints and floats by value: Triton specialises some ints on theirs


def _active(hook: Any) -> Any:
    """``hook``, or None when it is None or an empty ``knobs.HookChain``."""
    return None if hook is None or getattr(hook, "calls", True) == [] else hook


class BoundKernel:
    """One compiled kernel with its constexprs: ``bound(grid, *args)`` is a
    launch through the kernel's own Triton launcher and nothing else.
    Pointer arguments may be given as integers (device addresses): the
    launcher then skips both the ``data_ptr()`` call and its pointer query
    per argument. Launch hooks (a profiler's) are called as
    ``JITFunction.run`` calls them; Triton's default empty hook chains are
    skipped: building the launch metadata for them and calling them cost
    more than the rest of the launch."""

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
        # kernel.run first: reading it loads the kernel, which sets kernel.function.
        kernel.run(grid[0], grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,
                   enter, leave, *args, *self.constexprs)  # fmt: skip


class FastLauncher:
    """Launches one ``@triton.jit`` kernel as ``kernel[grid](*args, **meta)``
    does, without ``JITFunction.run`` after the first call of each
    specialisation. ``args`` are the kernel's runtime arguments in signature
    order; ``meta`` holds every constexpr argument (by name) and the launch
    options (``num_warps``, ``num_stages``)."""

    def __init__(self, fn: Any, variants: Optional[Callable[[Meta], List[Meta]]] = None):
        self.fn = fn
        # False for good: not a compiled kernel (the interpreter's), internals
        # missing, or a launcher that refused its arguments.
        self.fast = _JITFunction is not None and isinstance(fn, _JITFunction)
        self._kernels: Dict[Tuple, BoundKernel] = {}
        # variants(meta): the other launch settings a call with the same
        # arguments is likely to take, compiled ahead (module docstring).
        self.variants = variants
        self._ahead: Dict[Tuple, Future] = {}  # key -> its compile on the background threads

    # Keys hold integers by value; a long run of ever new values (say, a
    # token count) must not grow the table without bound.
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
        except TypeError:  # the compiled launcher parses its arguments before it launches anything
            self.fast = False
            self.fn[grid](*args, **meta)

    def bound(self, args: Sequence[Any], meta: Dict[str, Any]) -> Optional[BoundKernel]:
        """The compiled kernel that launches with ``args`` and ``meta`` took
        (None before the first such launch, or on the public path): for a
        caller that launches it many times with arguments of the same
        specialisation (the same dtypes, alignments and integer values)."""
        return self._kernels.get(self._key(args, meta)) if self.fast and AVAILABLE else None

    def _key(self, args: Sequence[Any], meta: Dict[str, Any]) -> Tuple:
        return current_device(), tuple(map(_arg_key, args)), tuple(meta.items())

    def _first_launch(self, key: Tuple, grid: Sequence[int], args: Sequence[Any], meta: Dict[str, Any]) -> None:
        ahead = self._ahead.pop(key, None)
        if ahead is not None:
            with contextlib.suppress(CancelledError):  # cancelled only while the interpreter exits
                ahead.result()  # compiling in the background: Triton finds it once done
        # Compiled (or found) without a launch, then launched through a BoundKernel.
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
        """Compile, on the background threads, this launch's kernel under
        each of ``self.variants(meta)``. Tensors are handed to Triton as
        their dtypes (its ``warmup`` takes them for 16-byte aligned
        pointers), so only launches whose tensors are aligned are compiled
        ahead, and no tensor is kept alive by a thread."""
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
        """One compile ahead (a background thread). A failure is only logged:
        the launch that needs the kernel compiles it and reports its error."""
        try:
            torch.cuda.set_device(device)
            self.fn.warmup(*stand_ins, grid=(1,), **meta)
        except Exception as exc:  # never let a guess break a launch
            logger.debug("compiling %s ahead for %s failed: %s", getattr(self.fn, "__name__", self.fn), meta, exc)

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
    On the launcher's public path (``AVAILABLE`` False, an interpreted
    kernel) nothing is bound and every launch goes through the launcher.

    A launch given its ``layer`` index also keeps that layer's whole
    argument tuple, with weak references to the layer's tensors and their
    addresses: :meth:`launch_again` then launches the layer with nothing
    rebuilt while it is handed the very same tensors at the same addresses
    (a piecewise graph's outputs and the pool's buffers are, step after
    step), and :meth:`rebind` swaps a step argument (the new tokens' slots)
    for the next step's.
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
        # layer index -> (weak refs to its tensors, their addresses, its kept argument tuple)
        self._layers: Dict[int, Tuple[tuple, tuple, tuple]] = {}

    def launch_again(self, layer: int, *layer_tensors: torch.Tensor) -> bool:
        """Launch ``layer`` as its last launch did, if it is handed the same
        tensor objects at the same addresses; False, launching nothing,
        otherwise. The same objects have the shapes, strides and dtypes the
        caller checked then."""
        kept = self.kept_launch(layer, layer_tensors)
        if kept is None:
            return False
        self.launch_kept(kept)
        return True

    def kept_launch(self, layer: int, layer_tensors: Sequence[torch.Tensor]) -> Optional[tuple]:
        """The launch :meth:`launch_again` would make (its argument tuple), or None."""
        entry = self._layers.get(layer)
        if entry is None:
            return None
        refs, ptrs, kept = entry
        for ref, tensor in zip(refs, layer_tensors):
            if ref() is not tensor:
                return None
        return kept if tuple(map(_data_ptr, layer_tensors)) == ptrs else None

    def launch_kept(self, kept: tuple) -> None:
        """Launch what :meth:`kept_launch` returned."""
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
                except TypeError:  # a launcher that takes no addresses: it parsed, launched nothing
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
        """Put ``tensor`` (checked by the caller like the one it replaces) at
        argument ``position``, a step tensor's, for the launches from now
        on. False, changing nothing, where the compiled kernel does not
        cover it: its 16-byte alignment differs from the one it replaces."""
        old = self._args[position]
        if (old.data_ptr() % 16 == 0) != (tensor.data_ptr() % 16 == 0):
            return False
        self._args[position] = tensor
        if self._addresses is not None and self._addresses[position] != tensor.data_ptr():
            self._addresses[position] = tensor.data_ptr()
            self._layers.clear()  # their argument tuples hold the old address
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
# Layer indices a StepLaunch keeps argument tuples for; a model has fewer.
_MAX_KEPT_LAYERS = 1024
