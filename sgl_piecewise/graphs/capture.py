"""The capture core: what every graph runner needs to capture CUDA graphs.

* one graph memory pool per device, shared by every runner of the process
  (piecewise pieces and whole-model graphs alike), so a size captured later
  reuses the memory an earlier, larger one reserved;
* one capture stream per device, for every warm-up and every capture: the
  caching allocator keeps a stream's freed blocks for that stream, and cuBLAS
  keeps a workspace per stream, so a new stream per size reserved new memory
  for every size;
* a warm-up on that stream before each capture (first calls compile kernels
  and allocate lazily, neither of which may happen while capturing);
* cuBLAS workspaces allocated inside the pool (``cublas_workspaces_into_pool``);
* Python's gc frozen while capturing (``frozen_gc``);
* sizes captured largest first, with a progress bar that shows the sizes
  done and the memory reserved.

Sharing one pool is safe because a process replays one graph at a time and
every graph rewrites its intermediates before reading them; memory that must
outlive a replay (a whole-model graph's output) stays owned by its runner.

On a machine without CUDA every recording is a pass-through: the function
runs once, eagerly, and no graph is kept.
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
    """Python's gc frozen while capturing: a collection during capture would
    walk every live object (SGLang measured capture 2.3-3.7x faster frozen).

    Nests by its own depth count, not ``gc.get_freeze_count()``: other code
    (Inductor's compile-worker pool, or the caller) freezes objects too, and
    that must not make a capture skip its freeze. The outermost exit thaws
    only if nothing was frozen when the outermost entry froze: ``gc`` cannot
    thaw some objects and not others, and thawing what the caller froze
    would undo the caller's freeze (the objects the capture froze then stay
    frozen with the caller's, as if the caller had frozen them).
    """

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
                # Garbage frozen now is collected after the thaw; only a
                # freeze that outlives the capture must not take it along
                # (a full collection costs ~0.2 s in a process with torch's
                # compiler loaded).
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
    """Call right before a capture: frees cuBLAS's workspaces, so the capture
    allocates them again, inside its pool.

    A workspace allocated outside the pool (by the warm-up run) would be
    baked into the graph while someone else may free it: torch.compile's
    reduce-overhead (cudagraph trees) clears every cuBLAS workspace before it
    records. The graph's matmuls then write their scratch into memory other
    tensors own (on an H200: an illegal address, after a reduce-overhead
    compile in the same process). Inside the pool the memory stays reserved
    for as long as the graphs live. On a torch without the call the
    workspaces stay, with a warning logged once (``internals/cuda_graph_pool.py``
    says when that is safe).
    """
    cuda_graph_pool.clear_cublas_workspaces()


class GraphCapture:
    """One device's pool and capture stream, and the steps of a capture.

    Get the process-wide one with :func:`shared_capture`; build your own only
    to keep a runner's graphs in a pool of their own.
    """

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
        """A one-element graph that keeps the pool alive as long as this core.

        The allocator releases a private pool once every graph captured into
        it is gone, and refuses a later capture into the same handle (an
        internal assert); runners come and go, the shared core stays.
        """
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
        """Capture ``fn`` into a graph in the shared pool; return ``(graph,
        outputs)``. Capturing executes nothing: replay the graph for real
        outputs. Without CUDA: ``(None, fn())``. A forward that waits for the
        device raises ``UnsupportedModeError`` naming ``what`` and the cause."""
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
        """Run the body on the capture stream, ordered after the work issued so
        far (a capture reads it), and order later work after the body."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)

    def begin_graph(self) -> torch.cuda.CUDAGraph:
        """Start capturing a new graph into the pool; call on the capture
        stream (``on_capture_stream``) and end it with ``end_graph`` (or
        ``abort_graph`` after a failure).

        A graph in several segments (the breakable runner: one per stretch
        between attention calls) begins each segment here, so every segment
        gets its cuBLAS workspace inside the pool, as ``record`` does.

        Until the capture ends, a torch operation that would wait for the
        device (``.item()``, ``.tolist()``, a branch on a tensor's value)
        raises before it reaches CUDA (``set_sync_debug_mode("error")``): a
        capture CUDA itself invalidates cannot be ended cleanly, and torch
        then leaves its allocator and its random generator in capture state.
        """
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
        """End a capture ``begin_graph`` began.

        When CUDA refuses to end it (the capture was invalidated by something
        outside torch's sync check), torch raises before it tells its
        allocator that the capture is over, and the pool would refuse every
        later capture ("already recording to mempool_id"). Later captures
        then go to a new pool (``_retire_pool``).
        """
        try:
            graph.capture_end()
        except BaseException:
            self._retire_pool()
            raise
        finally:
            torch.cuda.set_sync_debug_mode(self._sync_mode)
        track_graph(graph)  # freed before a group of several ranks is destroyed

    def abort_graph(self, graph: torch.cuda.CUDAGraph) -> None:
        """End a capture after its forward failed; the forward's error is the
        one to report, so an error of ending the capture is dropped."""
        try:
            self.end_graph(graph)
        except RuntimeError:
            pass

    def _retire_pool(self) -> None:
        """Capture into a new pool from now on. The old one stays alive (its
        anchor is kept) for the graphs captured into it; it is not shared
        with later graphs, which is the only cost."""
        with contextlib.suppress(RuntimeError):  # tell the allocator, where torch did not
            cuda_graph_pool.end_allocate_to_pool(self.device.index, self.pool)
        self._retired.append(self._anchor)
        self.pool = torch.cuda.graph_pool_handle()
        self._anchor = self._anchor_pool()

    def largest_first(self, sizes: Sequence[int], desc: str, unit: str, progress: bool = True) -> Iterator[int]:
        """``sizes`` from the largest down, with gc frozen and a progress bar
        of the sizes done and the memory reserved; at the end, synchronises
        and releases the scratch the phase left cached (``release_scratch``).
        The ranks of a tensor-parallel group go through the same sizes in
        lockstep (``lockstep.py``); rank 0 shows the bar."""
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
        """Give the device back the cached blocks outside the graph pool.

        The warm-ups ran on the capture stream, and the caching allocator
        keeps a stream's freed blocks for that stream alone: no step ever
        allocates on the capture stream, so those blocks (and the compiler's
        first-run scratch) would stay reserved and unusable for the life of
        the process. The pool's own segments stay: ``empty_cache`` leaves a
        private pool alone while a graph captured into it lives.
        """
        if self.use_cuda:
            with torch.cuda.device(self.device):
                torch.cuda.empty_cache()

    def pool_bytes(self) -> int:
        """Bytes of the segments the caching allocator holds for the pool
        captures go to now (0 without CUDA): the graphs' own memory."""
        if not self.use_cuda:
            return 0
        pool, device = tuple(self.pool), self.device.index
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                   if s.get("device") == device and tuple(s.get("segment_pool_id", ())) == pool)  # fmt: skip

    def synchronize(self) -> None:
        if self.use_cuda:
            torch.cuda.synchronize(self.device)


def explain_capture_failure(exc: BaseException, what: str) -> Optional[UnsupportedModeError]:
    """The error to raise instead of ``exc`` when a forward waited for the
    device while being captured (None for any other failure).

    A capture refuses torch's synchronising operations ("called a
    synchronizing CUDA operation", see ``GraphCapture.begin_graph``), and CUDA
    refuses any other with a bare "operation not permitted when stream is
    capturing"; the usual cause in model code is a Python branch on a
    tensor's value, which no CUDA graph can hold.
    """
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
