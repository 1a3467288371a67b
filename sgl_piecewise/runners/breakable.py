"""``BreakableCudaGraphRunner``: the eager model as CUDA graphs per token
count, in segments broken at every attention call; no compiler, so a model
Dynamo cannot trace still gets graphs. A replay runs segment 0, break 0
(attention on the real tokens), segment 1, and so on; recorded tensors are
non-owning aliases, safe because a replay repeats the capture's order.
docs/ARCHITECTURE.md, "BreakableCudaGraphRunner".

Without CUDA, "replay" runs the model eagerly, each attention call checked
against the break it stands for.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.compile.options import DEFAULT_MAX_CAPTURE_SIZE, default_capture_sizes
from sgl_piecewise.context import forward_context
from sgl_piecewise.errors import InvalidInputError, SglPiecewiseError
from sgl_piecewise.forward import ForwardBatch, ForwardMode
from sgl_piecewise.graphs.buffer_registry import FillContext
from sgl_piecewise.graphs.capture import GraphCapture, explain_capture_failure, shared_capture
from sgl_piecewise.graphs.counters import counters
from sgl_piecewise.graphs.fill_graphs import reserve_eager_bindings
from sgl_piecewise.graphs.input_registries import build_prefill_registry
from sgl_piecewise.graphs.weight_guard import WeightGuard
from sgl_piecewise.internals.storage_alias import non_owning_alias as _non_owning_alias
from sgl_piecewise.ops.attention import attention_with_output_direct
from sgl_piecewise.runners.protocols import GraphHost

TOKEN_FIELDS = ("input_ids", "positions", "out_cache_loc")


@dataclass
class Break:
    """One attention call of a captured forward, run eagerly between segments."""

    layer_id: int
    scale: Optional[float]
    tensors: Tuple[torch.Tensor, ...] = ()  # q, k, v, output: aliases into the pool (CUDA)

    def run(self) -> None:
        q, k, v, out = self.tensors
        attention_with_output_direct(q, k, v, out, self.layer_id, self.scale)


@dataclass
class SizeGraphs:
    """The graphs of one token count: ``len(breaks) + 1`` segments."""

    segments: List[Optional[torch.cuda.CUDAGraph]]  # None on a machine without CUDA
    breaks: List[Break]
    inputs: Tuple[torch.Tensor, torch.Tensor]  # registry views: input_ids, positions
    output: Optional[torch.Tensor] = None  # alias of the forward's output (CUDA)


class _Segmenting:
    """The step's backend as a breakable capture, or a replay without CUDA,
    shows it to the attention op: the ``watcher`` (a ``_Recorder`` or an
    ``_EagerChecker``) sees each call before and after the backend itself
    attends, and no per-step plan is built (every layer must come back here)."""

    def __init__(self, backend: Any, watcher: Union["_Recorder", "_EagerChecker"]):
        self.backend, self.watcher = backend, watcher
        self.req_to_token_pool, self.kv_pool = backend.req_to_token_pool, backend.kv_pool

    def write_kv_and_attend(self, q, k, v, out, layer_id, batch, scale, num_tokens, out_cache_loc) -> bool:
        self.watcher.attention(layer_id, scale, (q, k, v, out))
        self.backend.write_kv_and_attend(q, k, v, out, layer_id, batch, scale, num_tokens, out_cache_loc)
        self.watcher.after_attention()
        return False

    def layer_attend(self) -> None:
        return None


@dataclass
class _Recorder:
    """Records one size: each attention call ends the open segment and is
    recorded; it runs outside any graph, and the next segment begins."""

    core: Optional[GraphCapture]  # None: no CUDA, nothing to capture
    segments: List[Optional[torch.cuda.CUDAGraph]] = field(default_factory=list)
    breaks: List[Break] = field(default_factory=list)
    open: Optional[torch.cuda.CUDAGraph] = None

    def begin(self) -> None:
        self.open = self.core.begin_graph() if self.core is not None else None

    def end(self) -> None:
        graph, self.open = self.open, None
        if graph is not None:
            self.core.end_graph(graph)
        self.segments.append(graph)

    def abort(self) -> None:
        """End an open capture after a failure, keeping the first error."""
        graph, self.open = self.open, None
        if graph is not None:
            self.core.abort_graph(graph)

    def attention(self, layer_id: int, scale: Optional[float], tensors: Tuple[torch.Tensor, ...]) -> None:
        """Before the backend attends (zero real tokens: it zeroes the output)."""
        self.end()
        aliases = tuple(_non_owning_alias(t) for t in tensors) if self.core is not None else ()
        self.breaks.append(Break(layer_id, scale, aliases))

    def after_attention(self) -> None:
        self.begin()


@dataclass
class _EagerChecker:
    """A replay without CUDA: the model runs eagerly, and each attention call
    must be the break captured at its place."""

    size: int
    breaks: List[Break]
    seen: int = 0

    def attention(self, layer_id: int, scale: Optional[float], tensors: Tuple[torch.Tensor, ...]) -> None:
        want = self.breaks[self.seen].layer_id if self.seen < len(self.breaks) else None
        if want != layer_id:
            self._mismatch(f"layer {layer_id}")
        self.seen += 1

    def after_attention(self) -> None:
        pass

    def finish(self) -> None:
        if self.seen != len(self.breaks):
            self._mismatch("the end of the forward")

    def _mismatch(self, got: str) -> None:
        captured = [b.layer_id for b in self.breaks]
        raise SglPiecewiseError(
            f"breakable replay of {self.size} tokens: expected the attention calls captured "
            f"(layers {captured}), got {got} after {self.seen}; the model's Python took another "
            f"path than at capture, which a graph cannot follow"
        )


class BreakableCudaGraphRunner:
    """Breakable graphs for a ``ModelRunner`` (any backend), which serves steps
    from them once handed to its ``use_graphs`` (as its ``token_graphs``).
    ``capture_sizes``: token counts (default: the piecewise schedule);
    ``capture``: the capture core (default: the device's shared one)."""

    name = "breakable"
    axis = "tokens"  # use_graphs installs it as token_graphs

    def __init__(
        self,
        model_runner: GraphHost,
        capture_sizes: Optional[Sequence[int]] = None,
        capture: Optional[GraphCapture] = None,
    ):
        self.model_runner = model_runner
        self.capture_sizes = _check_sizes(capture_sizes)
        self.max_size = self.capture_sizes[-1]
        device = model_runner.device
        self.use_cuda = device.type == "cuda"
        self.registry = build_prefill_registry(
            self.max_size,
            model_runner.req_to_token_pool.max_reqs,
            device,
            seq_len_fill_value=model_runner.backend.get_cuda_graph_seq_len_fill_value(),
        )
        self.capture_core = capture if capture is not None else shared_capture(device)
        reserve_eager_bindings(model_runner.backend, model_runner.req_to_token_pool.max_reqs, self.max_size)
        self.graphs: Dict[int, SizeGraphs] = {}
        self.capture_seconds = 0.0
        self.captured = False
        self._weights: Optional[WeightGuard] = None

    def capture(self, progress: bool = True) -> float:
        """Capture every size, largest first; return the seconds it took."""
        start = time.perf_counter()
        self._weights = WeightGuard(self.model_runner.model, "breakable graphs")
        sizes = self.capture_core.largest_first(self.capture_sizes, "capturing breakable graphs", "size", progress)
        with torch.no_grad(), contextlib.closing(sizes):  # a failure thaws gc at once
            for size in sizes:
                self.graphs[size] = self._capture_one(size)
        self.capture_seconds = time.perf_counter() - start
        self.captured = True
        return self.capture_seconds

    def _capture_one(self, size: int) -> SizeGraphs:
        ctx = FillContext(raw_bs=0, padded_bs=0, raw_num_tokens=0, padded_num_tokens=size)  # all padding
        self.registry.fill_from(self._no_rows(), ctx)
        batch = self._capture_batch(ctx)
        if self.use_cuda:
            self.capture_core.warmup(lambda: self._forward(batch, None))
        recorder = _Recorder(self.capture_core if self.use_cuda else None)
        if self.use_cuda:
            with self.capture_core.on_capture_stream():
                output = self._record(recorder, batch, size)
        else:
            output = self._record(recorder, batch, size)
        counters.graphs_captured += len(recorder.segments)
        alias = _non_owning_alias(output) if self.use_cuda else None
        return SizeGraphs(recorder.segments, recorder.breaks, (batch.input_ids, batch.positions), alias)

    def _record(self, recorder: _Recorder, batch: ForwardBatch, size: int) -> torch.Tensor:
        recorder.begin()
        try:
            output = self._forward(batch, recorder)
            recorder.end()
        except BaseException as exc:
            recorder.abort()
            explained = explain_capture_failure(exc, f"breakable graphs of {size} tokens")
            if explained is not None:
                raise explained from exc
            raise
        return output

    def _forward(self, batch: ForwardBatch, recorder: Optional[_Recorder]) -> torch.Tensor:
        mr = self.model_runner
        backend = mr.backend if recorder is None else _Segmenting(mr.backend, recorder)
        with forward_context(batch, backend, check=False):
            return mr.model(batch.input_ids, batch.positions)

    def _no_rows(self) -> Dict[str, torch.Tensor]:
        return {slot.name: slot.buffer[:0] for slot in self.registry if slot.copy_from_fb}

    def _capture_batch(self, ctx: FillContext) -> ForwardBatch:
        """A step of ``ctx.padded_num_tokens`` rows, none of them real."""
        v = self.registry.extract(ctx)
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=0,
            input_ids=v["input_ids"],
            positions=v["positions"],
            seq_lens=v["seq_lens"],
            seq_lens_cpu=v["seq_lens_cpu"],
            extend_seq_lens=v["extend_seq_lens"],
            extend_prefix_lens=v["extend_prefix_lens"],
            req_pool_indices=v["req_pool_indices"],
            out_cache_loc=v["out_cache_loc"],
            num_token_non_padded=v["num_token_non_padded"],
        )

    def padded_size(self, num_tokens: int) -> Optional[int]:
        """The captured size ``num_tokens`` replays at, or None."""
        i = bisect.bisect_left(self.capture_sizes, num_tokens)
        if num_tokens < 1 or i == len(self.capture_sizes):
            return None
        size = self.capture_sizes[i]
        return size if size in self.graphs else None

    def replay(self, batch: ForwardBatch, padded: int) -> torch.Tensor:
        """Hidden states ``[num_tokens, H]`` of ``batch`` through the graphs of ``padded`` tokens."""
        mr = self.model_runner
        graphs = self.graphs[padded]
        n = batch.num_tokens
        self._weights.check_first()
        self.registry.fill_from(_sources(batch, n), FillContext(batch.batch_size, batch.batch_size, n, padded))
        mr.backend.init_forward_metadata(batch, check=False)
        counters.replays += len(graphs.segments)
        if graphs.output is None:
            out = self._replay_eagerly(graphs, batch, padded)[:n]
            self._weights.check()
            return out
        with forward_context(batch, mr.backend, check=False, debug_checks=mr.debug_checks):
            for segment, brk in zip(graphs.segments, graphs.breaks):
                segment.replay()
                brk.run()
            graphs.segments[-1].replay()
            self._weights.check()
        # A copy: the next replay (of any size: one pool) rewrites the output.
        return graphs.output[:n].clone()

    def _replay_eagerly(self, graphs: SizeGraphs, batch: ForwardBatch, padded: int) -> torch.Tensor:
        """Without CUDA: the model on the padded inputs, each attention call checked."""
        mr = self.model_runner
        checker = _EagerChecker(padded, graphs.breaks)
        with forward_context(batch, _Segmenting(mr.backend, checker), check=False, debug_checks=mr.debug_checks):
            out = mr.model(*graphs.inputs)
        checker.finish()
        return out


def _sources(batch: ForwardBatch, n: int) -> Union[ForwardBatch, Mapping[str, Any]]:
    """The batch, or its first ``n`` token rows where a caller padded it."""
    if all(getattr(batch, name).shape[0] == n for name in TOKEN_FIELDS):
        return batch
    rows = {name: getattr(batch, name)[:n] for name in TOKEN_FIELDS}
    rest = ("seq_lens", "seq_lens_cpu", "req_pool_indices", "extend_seq_lens", "extend_prefix_lens")
    return {**rows, **{name: getattr(batch, name) for name in rest}}


def _check_sizes(capture_sizes: Optional[Sequence[int]]) -> List[int]:
    if capture_sizes is None:
        return list(default_capture_sizes(DEFAULT_MAX_CAPTURE_SIZE))
    sizes = sorted({check_positive_int("capture_sizes", s) for s in capture_sizes})
    if not sizes:
        raise InvalidInputError(f"capture_sizes: expected at least one token count, got {list(capture_sizes)}")
    return sizes
