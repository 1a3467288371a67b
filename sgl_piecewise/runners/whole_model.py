"""``CudaGraphRunner``: the whole model as one CUDA graph per ``(mode, batch
size)``, attention inside, for the modes with a uniform number of new tokens
per request (``graph_modes.py``). Capture and replay fill the same registry,
so their inputs cannot drift; attention metadata goes through the backend's
capture/replay hooks. docs/ARCHITECTURE.md, "CudaGraphRunner".

Without CUDA, capture is a pass-through and "replay" runs the forward on the
static inputs, so CPU tests exercise everything but the graph itself.
"""

from __future__ import annotations

import bisect
import math
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from sgl_piecewise.backends.metadata import SEQ_LENS_SUM_UNKNOWN
from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.compile.options import default_capture_sizes
from sgl_piecewise.context import forward_context
from sgl_piecewise.errors import InvalidInputError, UnsupportedModeError
from sgl_piecewise.forward import ForwardBatch, ForwardMode
from sgl_piecewise.graphs.buffer_registry import CudaGraphBufferRegistry, FillContext
from sgl_piecewise.graphs.capture import GraphCapture, shared_capture
from sgl_piecewise.graphs.counters import counters
from sgl_piecewise.graphs.fill_graphs import record_fills
from sgl_piecewise.graphs.input_registries import SharedBufferPool, build_decode_registry
from sgl_piecewise.graphs.weight_guard import WeightGuard
from sgl_piecewise.runners.graph_modes import (
    ModeLayout,
    graph_spec,
    mode_layouts,
    refresh_prefix_lens,
    static_batch,
    why_eager,
)
from sgl_piecewise.runners.protocols import GraphHost

DEFAULT_MAX_DECODE_BS = 160  # SGLang's default --cuda-graph-max-bs

GraphKey = Tuple[ForwardMode, int]  # (mode, padded batch size)


class CudaGraphRunner:
    """Whole-model graphs for a ``ModelRunner``, which serves steps from them
    once handed to its ``use_graphs`` (as its ``step_graphs``).

    Args:
        capture_bs: batch sizes (default: ``default_capture_bs(max_reqs)``).
        forward: what the graphs record, ``forward(input_ids, positions)``
            (default: the eager model; a ``CompiledModel`` records Inductor's kernels).
        capture: the capture core; default: the device's shared one.
        num_tokens_per_req: the width of TARGET_VERIFY and DRAFT_EXTEND_V2
            graphs (``k + 1`` for ``k`` drafts); required with either.
        tree_mask: TARGET_VERIFY graphs read ``spec_info.custom_mask``.
        attn_tp_size, attn_tp_rank: the attention tensor-parallel split whose
            local ``num_token_non_padded`` the graphs read.
    """

    axis = "batch"  # use_graphs installs it as step_graphs

    def __init__(
        self,
        model_runner: GraphHost,
        capture_bs: Optional[Sequence[int]] = None,
        forward: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
        capture: Optional[GraphCapture] = None,
        *,
        modes: Sequence[ForwardMode] = (ForwardMode.DECODE,),
        num_tokens_per_req: Optional[int] = None,
        tree_mask: bool = False,
        attn_tp_size: int = 1,
        attn_tp_rank: int = 0,
    ):
        backend = model_runner.backend
        if not backend.supports_cuda_graph:
            raise UnsupportedModeError(
                f"CudaGraphRunner: expected a backend with supports_cuda_graph=True, got "
                f"{backend.name}; use the torch, triton or flashinfer backend"
            )
        self.layouts: Dict[ForwardMode, ModeLayout] = mode_layouts(modes, num_tokens_per_req, bool(tree_mask))
        for mode in self.layouts:
            backend.check_supported(mode)
        self.model_runner = model_runner
        self.forward = forward if forward is not None else model_runner.model
        max_width = max(layout.width for layout in self.layouts.values())
        self.capture_bs = _check_sizes(
            capture_bs, model_runner.req_to_token_pool.max_reqs, self._widths(), attn_tp_size
        )
        self.max_bs = self.capture_bs[-1]
        self.use_cuda = model_runner.device.type == "cuda"
        self._seq_len_fill = backend.get_cuda_graph_seq_len_fill_value()  # padded requests' seq_len
        self._host_lengths = backend.replay_reads_host_lengths
        self.registries = self._build_registries(attn_tp_size, attn_tp_rank)
        record_fills(backend)
        backend.init_cuda_graph_state(self.max_bs, self.max_bs * max_width)
        self._static: Dict[GraphKey, ForwardBatch] = {}  # the batch each graph reads
        self._graphs: Dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._outputs: Dict[GraphKey, torch.Tensor] = {}  # hidden [bs * w, H] in the pool
        self._fill_contexts: Dict[Tuple[ForwardMode, int, int], FillContext] = {}
        self.capture_core = capture if capture is not None else shared_capture(model_runner.device)
        self.capture_seconds = 0.0
        self.captured = False
        self._weights: Optional[WeightGuard] = None

    @property
    def modes(self) -> Tuple[ForwardMode, ...]:
        return tuple(self.layouts)

    def _widths(self) -> Tuple[int, ...]:
        return tuple(sorted({layout.width for layout in self.layouts.values()}))

    def _build_registries(self, attn_tp_size: int, attn_tp_rank: int) -> Dict[ForwardMode, CudaGraphBufferRegistry]:
        """One registry per mode over one pool: modes of one width share buffers."""
        pool = SharedBufferPool()
        device = self.model_runner.device
        return {
            mode: build_decode_registry(
                self.max_bs,
                device,
                seq_len_fill_value=self._seq_len_fill,
                num_tokens_per_bs=layout.width,
                attn_tp_size=attn_tp_size,
                attn_tp_rank=attn_tp_rank,
                with_accept_lengths=mode.is_draft_extend_v2(),
                host_seq_lens=self._host_lengths,
                pool=pool,
            )
            for mode, layout in self.layouts.items()
        }

    def capture(self, progress: bool = True) -> float:
        """Capture every mode at every size, largest first; return the seconds it took."""
        start = time.perf_counter()
        self._weights = WeightGuard(self.model_runner.model, "whole-model graphs")
        with torch.no_grad():
            for layout in self.layouts.values():
                desc = f"capturing {layout.label} graphs"
                for bs in self.capture_core.largest_first(self.capture_bs, desc, "bs", progress):
                    self._capture_one(layout, bs)
        self.capture_seconds = time.perf_counter() - start
        self.captured = True
        return self.capture_seconds

    def _capture_one(self, layout: ModeLayout, bs: int) -> None:
        registry = self.registries[layout.mode]
        ctx = FillContext.uniform(0, bs, layout.width)  # every request is padding
        registry.fill_from(self._no_rows(registry), ctx)
        static = static_batch(layout, registry.extract(ctx), bs)
        spec = graph_spec(layout, None, 0, bs, self._seq_len_fill, static.device)
        self.model_runner.backend.init_forward_metadata_capture_cuda_graph(
            bs, bs * layout.width, static.req_pool_indices, static.seq_lens, None, layout.mode, spec
        )
        key = (layout.mode, bs)
        self._static[key] = static
        counters.graphs_captured += 1
        # On every device: a compiled forward compiles here, not at the first step.
        self.capture_core.warmup(lambda: self._run(static))
        if not self.use_cuda:
            return
        backend = self.model_runner.backend
        fill_in_graph = backend.fill_in_graph(layout.mode, bs, static.req_pool_indices, static.seq_lens)

        def step() -> torch.Tensor:
            if fill_in_graph:
                backend.init_forward_metadata_replay_cuda_graph(
                    bs, static.req_pool_indices, static.seq_lens, SEQ_LENS_SUM_UNKNOWN, None, layout.mode, spec, None
                )
            return self._run(static)

        self._graphs[key], self._outputs[key] = self.capture_core.record(
            step, f"whole-model {layout.mode.name} graph of bs {bs}"
        )

    @staticmethod
    def _no_rows(registry: CudaGraphBufferRegistry) -> Dict[str, torch.Tensor]:
        """Sources of a fill with no real request: zero rows of every slot."""
        return {slot.name: slot.buffer[:0] for slot in registry if slot.copy_from_fb}

    def _run(self, static: ForwardBatch) -> torch.Tensor:
        """One forward over the static batch: what the graph records."""
        refresh_prefix_lens(static)
        with forward_context(static, self.model_runner.backend, check=False):  # padded static batch
            return self.forward(static.input_ids, static.positions)

    def padded_bs(self, batch: ForwardBatch) -> Optional[int]:
        """The captured size ``batch`` replays at, or None (eager)."""
        if batch.forward_mode not in self.layouts or not self._static:
            return None
        i = bisect.bisect_left(self.capture_bs, batch.batch_size)
        return self.capture_bs[i] if i < len(self.capture_bs) else None

    def captured_graph(self, mode: ForwardMode, bs: int) -> Optional[torch.cuda.CUDAGraph]:
        """The graph of ``bs`` requests of ``mode`` (None on a CPU or before capture)."""
        return self._graphs.get((mode, bs))

    def try_replay(self, batch: ForwardBatch) -> Optional[torch.Tensor]:
        """Hidden states ``[num_tokens, H]`` of ``batch``'s real tokens from a
        graph, or None (a batch of a served mode is counted as a fallback)."""
        layout = self.layouts.get(batch.forward_mode)
        if layout is None or not self._static:
            return None
        if batch.batch_size == 0 and not batch.forward_mode.is_idle():
            return None
        reason = why_eager(layout, batch)
        padded = self.padded_bs(batch)
        if reason is None and padded is None:
            reason = f"{layout.label} graphs: batch of {batch.batch_size} above the largest captured {self.max_bs}"
        if reason is not None:
            counters.fallback(reason)
            return None
        return self.replay(batch, padded)

    def replay(self, batch: ForwardBatch, padded_bs: int) -> torch.Tensor:
        """Hidden states of ``batch``'s real tokens through its mode's graph at ``padded_bs``."""
        mode, bs = batch.forward_mode, batch.batch_size
        layout = self.layouts[mode]
        key = (mode, padded_bs)
        if key not in self._static or bs > padded_bs:
            raise InvalidInputError(
                f"replay: expected a captured {layout.label} size >= {bs} "
                f"({self.capture_bs if self._static else 'none captured'}), got {padded_bs}"
            )
        self._weights.check_first()
        ctx = self._fill_contexts.get((mode, bs, padded_bs))
        if ctx is None:
            ctx = self._fill_contexts[(mode, bs, padded_bs)] = FillContext.uniform(bs, padded_bs, layout.width)
        self.registries[mode].fill_from(batch, ctx)
        static = self._static[key]
        spec = graph_spec(layout, batch, bs, padded_bs, self._seq_len_fill, static.device)
        seq_lens_sum = (
            batch.seq_lens_sum + self._seq_len_fill * (padded_bs - bs) if self._host_lengths else SEQ_LENS_SUM_UNKNOWN
        )
        self.model_runner.backend.init_forward_metadata_replay_cuda_graph(
            padded_bs,
            static.req_pool_indices,
            static.seq_lens,
            seq_lens_sum,
            None,
            mode,
            spec,
            static.seq_lens_cpu,
        )
        counters.replays += 1
        if not self.use_cuda:
            out = self._run(static)[: batch.num_tokens]
            self._weights.check()
            return out
        self._graphs[key].replay()
        self._weights.check()
        # A copy: the next replay (of any size: one pool) rewrites the output.
        return self._outputs[key][: batch.num_tokens].clone()


def default_capture_bs(max_reqs: int, multiple: int = 1) -> Tuple[int, ...]:
    """SGLang's schedule up to ``DEFAULT_MAX_DECODE_BS`` and the request table's
    size itself (a full table gets a graph of its own), multiples of
    ``multiple`` only (the table's size rounded down to one)."""
    most = min(max_reqs, DEFAULT_MAX_DECODE_BS)
    sizes = {s for s in (*default_capture_sizes(most), most // multiple * multiple) if s and s % multiple == 0}
    if not sizes:
        raise InvalidInputError(
            f"max_reqs: expected at least {multiple} requests (a graph's tokens split evenly over the "
            f"attention ranks), got {max_reqs}"
        )
    return tuple(sorted(sizes))


def _check_sizes(capture_bs: Optional[Sequence[int]], max_reqs: int, widths: Sequence[int], attn_tp_size: int) -> list:
    """Sorted sizes within the request table whose token counts ``bs * w``
    split evenly over the attention ranks."""
    check_positive_int("attn_tp_size", attn_tp_size)

    def splits(bs: int) -> bool:
        return all(bs * w % attn_tp_size == 0 for w in widths)

    if capture_bs is None:
        # The sizes that split are the multiples of this one.
        multiple = math.lcm(*(attn_tp_size // math.gcd(attn_tp_size, w) for w in widths))
        return list(default_capture_bs(max_reqs, multiple))
    sizes = sorted({check_positive_int("capture_bs", s) for s in capture_bs})
    if not sizes or sizes[-1] > max_reqs:
        raise InvalidInputError(
            f"capture_bs: expected sizes in [1, {max_reqs}] (the request table holds {max_reqs} "
            f"requests), got {list(capture_bs)}"
        )
    uneven = [s for s in sizes if not splits(s)]
    if uneven:
        raise InvalidInputError(
            f"capture_bs: expected sizes whose token counts (bs x {list(widths)} tokens per request) "
            f"divide by attn_tp_size={attn_tp_size}, got {uneven}"
        )
    return sizes
