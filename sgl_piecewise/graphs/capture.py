"""The capture core every graph runner shares: per device one graph pool
(safe: one graph replays at a time and rewrites its intermediates) and one
capture stream (the allocator and cuBLAS keep memory per stream). Without
CUDA, recording runs the function once, eagerly.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from tqdm.auto import tqdm

from sgl_piecewise.distributed import tensor_parallel, track_graph
from sgl_piecewise.errors import UnsupportedModeError
from sgl_piecewise.graphs import lockstep
from sgl_piecewise.internals import cuda_graph_pool


class _GcFreeze:
    """gc frozen while capturing. Nests by its own depth; the outermost exit
    thaws only if nothing was frozen at entry (others freeze objects too)."""

    def __init__(self) -> None:
        self.depth = 0
        self.thaw_on_exit = False
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self, collect_first: bool = False) -> Iterator[None]:
        with self.lock:
            self.depth += 1
            if self.depth == 1:
                self.thaw_on_exit = gc.get_freeze_count() == 0
                # A freeze that outlives the capture must not keep garbage.
                if collect_first and not self.thaw_on_exit:
                    gc.collect()
                gc.freeze()
        try:
            yield
        finally:
            with self.lock:
                self.depth -= 1
                if self.depth == 0 and self.thaw_on_exit:
                    gc.unfreeze()


frozen_gc = _GcFreeze()


def cublas_workspaces_into_pool() -> None:
    """Call right before a capture: frees cuBLAS's workspaces so the capture
    allocates them inside its pool, where no one else frees them."""
    cuda_graph_pool.clear_cublas_workspaces()


class GraphCapture:
    """One device's pool and capture stream (process-wide: :func:`shared_capture`)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.use_cuda = self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.use_cuda else None
        self.stream = torch.cuda.Stream(self.device) if self.use_cuda else None
        self._anchor = self._anchor_pool() if self.use_cuda else None
        self._retired: List[Tuple[torch.cuda.CUDAGraph, torch.Tensor]] = []  # anchors of retired pools
        self._sync_mode = 0  # torch's sync debug mode, restored when a capture ends

    def _anchor_pool(self) -> Tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """A one-element graph that keeps the pool alive as long as this core:
        the allocator releases a pool once its graphs are gone and then
        refuses captures into the same handle."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool)
            try:
                kept = torch.zeros(1, device=self.device)
            finally:
                graph.capture_end()
        return graph, kept

    def warmup(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` once on the capture stream, ordered after the work issued so far."""
        if not self.use_cuda:
            return fn()
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = fn()
        current.wait_stream(self.stream)
        return out

    def record(self, fn: Callable[[], Any], what: str = "a graph") -> Tuple[Optional[torch.cuda.CUDAGraph], Any]:
        """Capture ``fn`` into the pool; return ``(graph, outputs)`` (without
        CUDA: ``(None, fn())``). A forward that waits for the device raises
        ``UnsupportedModeError`` naming ``what``."""
        if not self.use_cuda:
            return None, fn()
        with self.on_capture_stream():
            graph = self.begin_graph()
            try:
                out = fn()
            except BaseException as exc:
                self.abort_graph(graph)
                explained = explain_capture_failure(exc, what)
                if explained is not None:
                    raise explained from exc
                raise
            self.end_graph(graph)
        return graph, out

    @contextlib.contextmanager
    def on_capture_stream(self) -> Iterator[None]:
        """Run the body on the capture stream, ordered after earlier work and before later work."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)

    def begin_graph(self) -> torch.cuda.CUDAGraph:
        """Start capturing, on the capture stream; end with ``end_graph``. Until
        then an op that waits for the device raises before it reaches CUDA,
        which would invalidate the capture beyond a clean end."""
        cublas_workspaces_into_pool()
        graph = torch.cuda.CUDAGraph()
        self._sync_mode = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings():  # "a prototype feature": known, and all we rely on is .item() & co.
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        try:
            graph.capture_begin(pool=self.pool)
        except BaseException:
            torch.cuda.set_sync_debug_mode(self._sync_mode)
            raise
        return graph

    def end_graph(self, graph: torch.cuda.CUDAGraph) -> None:
        """End a capture ``begin_graph`` began. If CUDA refuses, torch never
        tells its allocator, and the pool would refuse later captures: they
        go to a new pool (``_retire_pool``)."""
        try:
            graph.capture_end()
        except BaseException:
            self._retire_pool()
            raise
        finally:
            torch.cuda.set_sync_debug_mode(self._sync_mode)
        track_graph(graph)  # freed before a group of several ranks is destroyed

    def abort_graph(self, graph: torch.cuda.CUDAGraph) -> None:
        """End a capture after its forward failed, dropping any error of ending it."""
        try:
            self.end_graph(graph)
        except RuntimeError:
            pass

    def _retire_pool(self) -> None:
        """Capture into a new pool from now on; the old one lives on for its graphs."""
        with contextlib.suppress(RuntimeError):  # tell the allocator, where torch did not
            cuda_graph_pool.end_allocate_to_pool(self.device.index, self.pool)
        self._retired.append(self._anchor)
        self.pool = torch.cuda.graph_pool_handle()
        self._anchor = self._anchor_pool()

    def largest_first(self, sizes: Sequence[int], desc: str, unit: str, progress: bool = True) -> Iterator[int]:
        """``sizes`` from the largest down, with gc frozen and a progress bar;
        tensor-parallel ranks go in lockstep. Releases the scratch at the end."""
        order = sorted(sizes, reverse=True)
        tp = tensor_parallel()
        lockstep.check_same_sizes(tp, order, desc)
        shown = progress and tp.is_first
        with frozen_gc(collect_first=True), tqdm(order, desc=desc, unit=unit, disable=not shown) as bar:
            for size in bar:
                lockstep.meet(tp, self.device)
                yield size
                if self.use_cuda:
                    bar.set_postfix_str(f"reserved {torch.cuda.memory_reserved(self.device) / 2**30:.2f} GiB")
        self.synchronize()
        self.release_scratch()

    def release_scratch(self) -> None:
        """Give back cached blocks outside the pool: the warm-ups' belong to
        the capture stream, which no step allocates on."""
        if self.use_cuda:
            with torch.cuda.device(self.device):
                torch.cuda.empty_cache()

    def pool_bytes(self) -> int:
        """Bytes the allocator holds for the current pool (0 without CUDA)."""
        if not self.use_cuda:
            return 0
        pool, device = tuple(self.pool), self.device.index
        return sum(
            s["total_size"]
            for s in torch.cuda.memory_snapshot()
            if s.get("device") == device and tuple(s.get("segment_pool_id", ())) == pool
        )

    def synchronize(self) -> None:
        if self.use_cuda:
            torch.cuda.synchronize(self.device)


def explain_capture_failure(exc: BaseException, what: str) -> Optional[UnsupportedModeError]:
    """The error to raise instead of ``exc`` when a forward waited for the
    device while captured (torch's or CUDA's refusal); None otherwise."""
    text = str(exc)
    refused = ("synchronizing CUDA operation", "is capturing", "during capture")
    if not isinstance(exc, RuntimeError) or not any(r in text for r in refused):
        return None
    return UnsupportedModeError(
        f"{what}: expected a forward that never waits for the device while it is captured, got "
        f"{text.splitlines()[0]!r}; a Python branch on a tensor's value (`if t.sum() > 0`, `.item()`, "
        f"`.tolist()`) reads the device, which no CUDA graph can hold: make it branch-free "
        f"(torch.where) or run the model without graphs"
    )


_shared: Dict[torch.device, GraphCapture] = {}
_shared_lock = threading.Lock()


def shared_capture(device: torch.device | str) -> GraphCapture:
    """The process-wide capture core of ``device`` (made on first use)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _shared_lock:
        if device not in _shared:
            _shared[device] = GraphCapture(device)
        return _shared[device]
