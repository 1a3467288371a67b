"""Our compiled Triton kernels launched through torch's own CUDA launcher.

Triton launches a compiled kernel through a C launcher that it generates
per kernel signature and builds with the host's C compiler the first time
it sees that signature (0.38-0.39 s for a 16-argument kernel on the H100
hosts measured, docs/BENCHMARKS.md; cached on disk after). A cold start
builds one per kernel we launch. Inductor launches the kernels it compiles
through a launcher built into torch instead
(``torch._C._StaticCudaLauncher``): it loads the kernel's cubin and calls
``cuLaunchKernel`` with the arguments packed by a type string.
:func:`static_kernel` hands one of our compiled kernels to it, so our
kernels need no C compiler either, and a launch costs about 1 µs less host
time (6.1-7.8 against 7.1-8.8 µs for that kernel through ``BoundKernel``).

Where it does not apply, :func:`static_kernel` returns None and the caller
keeps Triton's launcher: a torch without the static launcher, ROCm, a
kernel that needs what the static launcher does not do (several CTAs,
cooperative or programmatic-dependent launch, global or profile scratch, a
TMA descriptor argument), or a launch hook active when the kernel is first
loaded (the static launcher calls no hooks).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import tempfile
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

logger = logging.getLogger("sgl_piecewise.triton")


@functools.lru_cache(maxsize=None)
def _wrapper_class() -> Any:
    """torch's Python wrapper of its static launcher (found under either
    name its module has had across torch releases), or None."""
    if torch.version.cuda is None:
        return None
    for module in ("static_triton_launcher", "static_cuda_launcher"):
        try:
            runtime = importlib.import_module(f"torch._inductor.runtime.{module}")
        except ImportError:
            continue
        cls = getattr(runtime, "StaticallyLaunchedCudaKernel", None)
        if cls is not None:
            return cls
    return None


def kept_positions(arg_names: Sequence[str], signature: Dict[Any, str], constants: Dict[Any, Any],
                   num_args: int) -> Optional[Tuple[int, ...]]:  # fmt: skip
    """Which of a launch's ``num_args`` runtime arguments the compiled
    kernel takes, in order: Triton drops the ones it specialised into
    constants (an integer equal to 1, a None pointer). None when it keeps
    them all (the common case: the launch passes its arguments as they
    are). ``signature`` and ``constants`` are the compiled source's, keyed
    by name, by index or by a one-element tuple of the index depending on
    Triton's version."""

    def index(key: Any) -> int:
        if isinstance(key, str):
            return arg_names.index(key)
        return key[0] if isinstance(key, tuple) else key

    types = {index(key): ty for key, ty in signature.items()}
    dropped = {index(key) for key in constants} | {i for i, ty in types.items() if ty == "constexpr"}
    kept = tuple(i for i in range(num_args) if i not in dropped)
    return None if len(kept) == num_args else kept


class StaticKernel:
    """One compiled kernel loaded for torch's static launcher:
    ``kernel(grid, stream, args)`` launches it with a launch's runtime
    arguments (tensors, or pointers as integer device addresses)."""

    def __init__(self, wrapper: Any, kept: Optional[Tuple[int, ...]]):
        self._wrapper = wrapper  # owns the loaded module: kept as long as this is
        # launch_packed(*self.packed(grid, args), stream) launches.
        self.launch_packed = wrapper.C_impl._launch_kernel
        self.function, self.num_warps, self.shared = wrapper.function, wrapper.num_warps, wrapper.shared
        # Triton's compiled kernels take trailing scratch pointers where the
        # compiler reserves them (none of ours uses any: a null each).
        self.extra = tuple(None for needed in (wrapper.has_global_scratch, wrapper.has_profile_scratch) if needed)
        self.arg_types = wrapper.arg_tys + "O" * len(self.extra)
        self.kept = kept

    def __call__(self, grid: Sequence[int], stream: int, args: Sequence[Any]) -> None:
        self.launch_packed(*self.packed(grid, args), stream)

    def packed(self, grid: Sequence[int], args: Sequence[Any]) -> tuple:
        """A launch of ``grid`` and ``args`` in ``launch_packed``'s argument
        order, all but the stream: a caller that launches the same arguments
        many times packs them once (``launch.StepLaunch``)."""
        kept = args if self.kept is None else [args[i] for i in self.kept]
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        return (self.function, grid[0], grid_1, grid_2, self.num_warps, self.shared, self.arg_types,
                (*kept, *self.extra))  # fmt: skip


# Loaded kernels by (Triton's hash of the compiled kernel, device), for the
# life of the process: a CUDA graph that recorded a launch holds the loaded
# function's address, and unloading its module would leave that dangling.
# Refusals are not kept: one made while a launch hook was active would not
# hold once it is gone.
_loaded: Dict[Tuple[str, int], StaticKernel] = {}


def static_kernel(kernel: Any, num_args: int, device: int) -> Optional[StaticKernel]:
    """``kernel`` (a Triton ``CompiledKernel`` whose launches pass
    ``num_args`` runtime arguments) loaded on ``device`` for torch's static
    launcher, or None where it does not apply (module docstring)."""
    key = (getattr(kernel, "hash", None), device)
    static = _loaded.get(key)
    if static is None:
        static = _load(kernel, num_args, device)
        if static is not None and key[0] is not None:
            _loaded[key] = static
    return static


def _load(kernel: Any, num_args: int, device: int) -> Optional[StaticKernel]:
    cls = _wrapper_class()
    metadata = getattr(kernel, "metadata", None)
    if cls is None or metadata is None or "cubin" not in getattr(kernel, "asm", {}):
        return None
    if getattr(metadata, "launch_cooperative_grid", False) or getattr(metadata, "launch_pdl", False):
        return None
    try:
        kept = kept_positions(kernel.src.fn.arg_names, kernel.src.signature, getattr(kernel.src, "constants", {}),
                              num_args)  # fmt: skip
        wrapper = _load_cubin(cls, kernel, device)
    except Exception as exc:  # NotImplementedError for what it does not launch; anything else: keep Triton's
        logger.debug("static launch of %s not used: %s", getattr(kernel, "name", kernel), exc)
        return None
    if len(wrapper.arg_tys) != (num_args if kept is None else len(kept)):
        logger.debug("static launch of %s not used: argument types %r", kernel.name, wrapper.arg_tys)
        return None
    return StaticKernel(wrapper, kept)


def _load_cubin(cls: Any, kernel: Any, device: int) -> Any:
    """The wrapper reads the cubin from a file; the compiled kernel holds it
    in memory, so it goes through a temporary file, removed once loaded."""
    fd, path = tempfile.mkstemp(suffix=".cubin", prefix="sgl_piecewise_")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(kernel.asm["cubin"])
        kernel._cubin_path = path  # where the wrapper looks (Inductor sets it the same way)
        wrapper = cls(kernel)
        wrapper.load_kernel(device)
    finally:
        os.unlink(path)
        if hasattr(kernel, "_cubin_path"):
            del kernel._cubin_path
    return wrapper
