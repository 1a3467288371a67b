"""A model's distinct pieces compile while Inductor's workers compile the
kernels of the pieces before them.

Inductor hands a graph's Triton (or C++) kernels to its compile worker
processes and waits for all of them when the graph's compiled module loads,
at the end of that graph's compile (``AsyncCompile.wait``). The distinct
pieces of a split model compile one after another, so the main thread sat
idle through each piece's wait before it began lowering the next one: 0.9–1.4 s
of the backend's 3.6–6.0 s in cold starts of the 0.5B shape on H200
machines (docs/BENCHMARKS.md).

Inside :func:`deferred_kernel_waits`, a loading module's wait is noted
instead of done, and every noted wait is done at the context's exit: the
workers compile one piece's kernels while the main thread lowers the next,
and the backend then waits once, for whatever is left. A compiled piece
must not run before the exit (its kernels are futures until then); the
backend only compiles pieces inside it, running the original graphs on fake
tensors. A kernel that failed to compile raises at the exit, as it would
have at its own wait.

What this gives up: Inductor bundles the Triton binaries a graph compiled
into its cache entry (``TritonBundler``) before the graph's compile returns,
and a kernel waited for later is missing from that bundle. A later process
that loads the entry finds the kernel in Triton's own cache, or compiles it
again where that cache is empty. So compiles that are saved for other
processes (``CompileOptions(cache_dir=...)``) do not defer their waits.

It defers the waits of the threads inside it only, and does nothing where the
installed torch has no ``AsyncCompile._wait_futures``, where Inductor runs
a graph's kernels during its compile (its C++ wrapper, tuning launches at
compile time), or where it compiles its kernels in-process (one compile
thread: nothing to wait for).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

from sgl_piecewise.graphs.counters import counters

logger = logging.getLogger("sgl_piecewise.compile")

_local = threading.local()  # .scopes: the waits noted on this thread, or None
_lock = threading.Lock()  # guards the two below
_inductors_wait: Optional[Callable] = None  # AsyncCompile's own _wait_futures, while replaced
_threads_inside = 0


def _noted_scopes() -> Optional[List[Dict[str, Any]]]:
    return getattr(_local, "scopes", None)


@contextlib.contextmanager
def deferred_kernel_waits() -> Iterator[None]:
    """Compiles inside note their kernel waits; the exit does them all.
    Nested use joins the outer one."""
    async_compile = _async_compile_class()
    if async_compile is None or _noted_scopes() is not None or _kernels_run_while_compiling():
        yield
        return
    wait_now = _install(async_compile)
    scopes: List[Dict[str, Any]] = []
    _local.scopes = scopes
    try:
        yield
    finally:
        # On an error the pieces are thrown away: their workers' compiles just finish.
        _local.scopes = None
        _uninstall(async_compile)
    wait_for_all(async_compile(), wait_now, scopes)


def _install(async_compile: type) -> Callable:
    """Put the noting ``_wait_futures`` in place (once, for every thread
    inside); Inductor's own, which waits."""
    global _inductors_wait, _threads_inside
    with _lock:
        if _threads_inside == 0:
            _inductors_wait = async_compile._wait_futures
            async_compile._wait_futures = _wait_or_note(_inductors_wait)
        _threads_inside += 1
        return _inductors_wait


def _uninstall(async_compile: type) -> None:
    """Inductor's own ``_wait_futures`` back once the last thread is out."""
    global _inductors_wait, _threads_inside
    with _lock:
        _threads_inside -= 1
        if _threads_inside == 0:
            async_compile._wait_futures, _inductors_wait = _inductors_wait, None


def wait_for_all(waiter: Any, wait_now, scopes: List[Dict[str, Any]]) -> None:
    """The noted waits, in the order they were noted (each puts its
    module's kernels in place of their futures)."""
    start = time.perf_counter()
    for scope in scopes:
        wait_now(waiter, scope)
    counters.kernel_waits_deferred += len(scopes)
    logger.debug("waited %.3f s for the kernels of %d deferred compiles", time.perf_counter() - start, len(scopes))


def _async_compile_class() -> Optional[type]:
    """Inductor's ``AsyncCompile`` where it waits through ``_wait_futures``, else None."""
    try:
        from torch._inductor.async_compile import AsyncCompile
    except ImportError:
        return None
    return AsyncCompile if callable(getattr(AsyncCompile, "_wait_futures", None)) else None


def _kernels_run_while_compiling() -> bool:
    """Does Inductor run a graph's kernels before its compile returns? With
    its C++ wrapper it runs them to tune their launches
    (``triton.autotune_at_compile_time``): they must be there."""
    from torch._inductor import config

    return bool(getattr(config, "cpp_wrapper", False) or getattr(config.triton, "autotune_at_compile_time", False))


def _wait_or_note(wait_now):
    """``_wait_futures`` that notes the scope on a thread inside
    :func:`deferred_kernel_waits` and waits at once on any other."""

    def wait_or_note(self, scope: Dict[str, Any]) -> None:
        scopes = _noted_scopes()
        if scopes is None:
            wait_now(self, scope)
        else:
            scopes.append(scope)  # the loading module's globals: its futures, replaced at the exit

    return wait_or_note
