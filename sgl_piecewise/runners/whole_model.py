"""``CudaGraphRunner``: the whole model as one CUDA graph per ``(mode, batch
size)``, with attention inside the graph, for every mode with a uniform
number of new tokens per request: DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2 and
IDLE (``runners/graph_modes.py`` holds what differs between them).

Every static input comes from one registry per mode (``build_decode_registry``
with ``num_tokens_per_bs`` = the mode's width, buffers shared through one
pool): a capture fills its dummy batch through it (every request padding), a
replay fills the real batch through it, so the two cannot drift (upstream
SGLang PRs 22404 and 26742) — ``num_token_non_padded`` included, also as the
local count of a simulated attention-TP rank (``attn_tp_size``,
``attn_tp_rank``). Attention metadata goes through the backend's
capture/replay hooks (Pattern A/B, docs/ARCHITECTURE.md, "Pattern A and
Pattern B"), which key their static metadata per ``(mode, bs)``; host work
such as FlashInfer's ``plan()`` runs in the hook, before the graph is
launched, never inside it. Where the backend's fill is device work alone
(``fill_in_graph``), the graph records it with the model, reading the
registry's buffers, and the replay hook only checks the step. A host copy
of the lengths (``seq_lens_cpu``, and ``seq_lens_sum``) is kept and passed
only where the backend's replay hook reads it
(``AttentionBackend.replay_reads_host_lengths``; none of this library's
backends does).

Sizes are captured largest first into one memory pool, with Python's gc
frozen and a progress bar. A batch is padded to the smallest captured size
that holds it: padded requests have ``seq_len`` = the backend's fill value
(in TARGET_VERIFY and DRAFT_EXTEND_V2 that is their prefix), request row 0
and, for each of their ``w`` tokens, the dummy KV slot. Batches of a served
mode that no graph fits (above the largest size, another width, a ragged
draft-extend step, another mask kind) run eagerly and are counted in
``counters.eager_fallbacks``; steps of other modes run eagerly, uncounted.

Graphs output hidden states only; logits are computed outside, for the rows
the caller needs (every row in TARGET_VERIFY, the last accepted token of
each request in DRAFT_EXTEND_V2): no sampling or top-k inside a graph
(upstream SGLang PR 25002).

On a machine without CUDA, capture is a pass-through: the hooks and the
registry run as on a GPU, and "replay" runs the model eagerly on the static
inputs, so CPU tests exercise everything but the graph itself.
"""

from __future__ import annotations

import bisect
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

# SGLang's default largest decode graph (`--cuda-graph-max-bs` on most cards).
DEFAULT_MAX_DECODE_BS = 160

GraphKey = Tuple[ForwardMode, int]  # (mode, padded batch size)


class CudaGraphRunner:
    """Whole-model graphs for a ``ModelRunner``; installs itself as the
    runner's ``step_graphs``, so ``forward_step`` replays a graph whenever one
    fits the batch.

    Args:
        model_runner: the ``ModelRunner`` whose model, pools and backend the
            graphs use. Its backend must support CUDA graphs and every mode.
        capture_bs: batch sizes to capture (default: SGLang's schedule up to
            ``DEFAULT_MAX_DECODE_BS``, capped by the request table's size).
        forward: what the graphs record, ``forward(input_ids, positions)``
            (default: the runner's model, eager kernels). A compiled model,
            e.g. ``CompiledModel(model, CompileOptions())``, records
            Inductor's fused kernels instead: fewer launches per step.
        capture: the capture core (pool, stream); default: the process-wide
            one of the runner's device, shared with every other runner.
        modes: the modes to capture, each at every size (default: DECODE).
        num_tokens_per_req: the uniform width of TARGET_VERIFY and
            DRAFT_EXTEND_V2 graphs (required with either, refused without).
            For greedy verification of ``k`` draft tokens it is ``k + 1``:
            the last accepted token and the ``k`` drafts
            (``sgl_piecewise.engine.speculative``).
        tree_mask: TARGET_VERIFY graphs read a tree mask
            (``spec_info.custom_mask``); off by default (chain drafts,
            causal). A graph serves one mask kind.
        attn_tp_size, attn_tp_rank: the attention tensor-parallel split whose
            local ``num_token_non_padded`` the graphs read (upstream SGLang
            PR 22404); every captured size's token count must divide by it.
    """

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
        self.capture_bs = _check_sizes(capture_bs, model_runner.req_to_token_pool.max_reqs,
                                       self._widths(), attn_tp_size)  # fmt: skip
        self.max_bs = self.capture_bs[-1]
        self.use_cuda = model_runner.device.type == "cuda"
        self._seq_len_fill = backend.get_cuda_graph_seq_len_fill_value()  # padded requests' seq_len
        # A host copy of the lengths (and their sum) only for a replay hook that reads them.
        self._host_lengths = backend.replay_reads_host_lengths
        self.registries = self._build_registries(attn_tp_size, attn_tp_rank)
        record_fills(backend)
        backend.init_cuda_graph_state(self.max_bs, self.max_bs * max_width)
        self._static: Dict[GraphKey, ForwardBatch] = {}  # the batch each graph reads
        self._graphs: Dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._outputs: Dict[GraphKey, torch.Tensor] = {}  # hidden [bs * w, H] in the pool
        # (mode, real bs, padded bs) -> its fill's sizes: immutable, built once
        # rather than before every replay.
        self._fill_contexts: Dict[Tuple[ForwardMode, int, int], FillContext] = {}
        self.capture_core = capture if capture is not None else shared_capture(model_runner.device)
        self.capture_seconds = 0.0
        self._weights: Optional[WeightGuard] = None  # where the captured graphs read the weights
        model_runner.step_graphs = self

    @property
    def modes(self) -> Tuple[ForwardMode, ...]:
        return tuple(self.layouts)

    def _widths(self) -> Tuple[int, ...]:
        return tuple(sorted({layout.width for layout in self.layouts.values()}))

    def _build_registries(self, attn_tp_size: int, attn_tp_rank: int) -> Dict[ForwardMode, CudaGraphBufferRegistry]:
        """One registry per mode; one pool, so modes of one width share their
        buffers (graphs of a device run one at a time, and every fill rewrites
        what its graph reads)."""
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
            )  # fmt: skip
            for mode, layout in self.layouts.items()
        }

    # ---- capture ----------------------------------------------------------
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
        if not self.use_cuda:
            return
        self.capture_core.warmup(lambda: self._run(static))
        backend = self.model_runner.backend
        # Where the backend lets it, the graph holds the metadata fill too, so a
        # replay launches nothing but the registry's copies before the graph.
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

    # ---- replay -----------------------------------------------------------
    def padded_bs(self, batch: ForwardBatch) -> Optional[int]:
        """The captured size ``batch`` replays at, or None (eager). An IDLE
        step has no requests and replays the smallest size; a caller that
        must run a given size (DP attention) calls :meth:`replay` with it."""
        if batch.forward_mode not in self.layouts or not self._static:
            return None
        i = bisect.bisect_left(self.capture_bs, batch.batch_size)
        return self.capture_bs[i] if i < len(self.capture_bs) else None

    def captured_graph(self, mode: ForwardMode, bs: int) -> Optional[torch.cuda.CUDAGraph]:
        """The graph captured for ``bs`` requests of ``mode`` (None on a CPU or
        before capture), for profiling."""
        return self._graphs.get((mode, bs))

    def try_replay(self, batch: ForwardBatch) -> Optional[torch.Tensor]:
        """Hidden states ``[num_tokens, H]`` of every real token of ``batch``
        from a graph, or None when no captured graph serves it (the caller
        runs eagerly; batches of a served mode are counted)."""
        layout = self.layouts.get(batch.forward_mode)
        if layout is None or not self._static:
            return None
        if batch.batch_size == 0 and not batch.forward_mode.is_idle():
            return None  # nothing to run: the eager path handles an empty step
        reason = why_eager(layout, batch)
        padded = self.padded_bs(batch)
        if reason is None and padded is None:
            reason = f"{layout.label} graphs: batch of {batch.batch_size} above the largest captured {self.max_bs}"
        if reason is not None:
            counters.fallback(reason)
            return None
        return self.replay(batch, padded)

    def replay(self, batch: ForwardBatch, padded_bs: int) -> torch.Tensor:
        """Run ``batch`` through the graph of its mode at ``padded_bs``
        (checked by :meth:`try_replay`); hidden states of its real tokens."""
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
            padded_bs, static.req_pool_indices, static.seq_lens, seq_lens_sum, None, mode, spec,
            static.seq_lens_cpu,
        )  # fmt: skip
        counters.replays += 1
        if not self.use_cuda:
            out = self._run(static)[: batch.num_tokens]
            self._weights.check()
            return out
        self._graphs[key].replay()
        self._weights.check()  # while the card runs the graph (weight_guard.py)
        # A copy: the next replay (of any size: one pool) rewrites the graph's output.
        return self._outputs[key][: batch.num_tokens].clone()


def _check_sizes(capture_bs: Optional[Sequence[int]], max_reqs: int, widths: Sequence[int], attn_tp_size: int) -> list:
    """Sorted sizes, each within the request table and, under attention TP,
    with a token count ``bs * w`` every rank holds an even share of."""
    check_positive_int("attn_tp_size", attn_tp_size)

    def splits(bs: int) -> bool:
        return all(bs * w % attn_tp_size == 0 for w in widths)

    if capture_bs is None:
        sizes = [s for s in default_capture_sizes(DEFAULT_MAX_DECODE_BS) if s <= max_reqs and splits(s)]
        if sizes:
            return sizes
        capture_bs = [max_reqs]
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
