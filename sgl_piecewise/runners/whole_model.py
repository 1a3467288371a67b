"""``CudaGraphRunner``: the whole model as one CUDA graph per batch size, for
DECODE steps, with attention inside the graph.

Every static input comes from one registry (``build_decode_registry``): a
capture fills its dummy batch through it (every request padding), a replay
fills the real batch through it, so the two cannot drift (upstream SGLang PRs 22404 and 26742).
Attention metadata goes through the backend's capture/replay hooks (Pattern
A/B, docs/ARCHITECTURE.md, "Pattern A and Pattern B"): capture binds the backend's static buffers, replay
refills them; host-side work such as FlashInfer's ``plan()`` runs in the hook,
before the graph is launched, never inside it.

Sizes are captured largest first into one memory pool, with Python's gc
frozen and a progress bar. A batch is padded to the smallest captured size
that holds it: padded requests have ``seq_len`` = the backend's fill value,
request row 0 and the dummy KV slot. Batches above the largest size, and
steps of other modes, run eagerly; decode batches that do are counted in
``counters.eager_fallbacks``.

On a machine without CUDA, capture is a pass-through: the hooks and the
registry run as on a GPU, and "replay" runs the model eagerly on the static
inputs, so CPU tests exercise everything but the graph itself.

Only DECODE (one new token per request) for now; TARGET_VERIFY and
DRAFT_EXTEND_V2 (uniform width, spec info) are the next modes.
"""

from __future__ import annotations

import bisect
import time
from typing import Callable, Dict, Optional, Sequence

import torch

from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.compile.counters import counters
from sgl_piecewise.compile.options import default_capture_sizes
from sgl_piecewise.errors import InvalidInputError, UnsupportedModeError
from sgl_piecewise.forward import ForwardBatch, ForwardMode, forward_context
from sgl_piecewise.runners.buffer_registry import FillContext
from sgl_piecewise.runners.capture import GraphCapture, shared_capture
from sgl_piecewise.runners.input_registries import build_decode_registry

# SGLang's default largest decode graph (`--cuda-graph-max-bs` on most cards).
DEFAULT_MAX_DECODE_BS = 160


class CudaGraphRunner:
    """Whole-model decode graphs for a ``ModelRunner``; installs itself as the
    runner's ``step_graphs``, so ``forward_step`` replays a graph whenever one
    fits the batch.

    Args:
        model_runner: the ``ModelRunner`` whose model, pools and backend the
            graphs use. Its backend must support CUDA graphs.
        capture_bs: batch sizes to capture (default: SGLang's schedule up to
            ``DEFAULT_MAX_DECODE_BS``, capped by the request table's size).
        forward: what the graphs record, ``forward(input_ids, positions)``
            (default: the runner's model, eager kernels). A compiled model,
            e.g. ``CompiledModel(model, CompileOptions())``, records
            Inductor's fused kernels instead: fewer launches per step.
        capture: the capture core (pool, stream); default: the process-wide
            one of the runner's device, shared with every other runner.
    """

    mode = ForwardMode.DECODE

    def __init__(
        self,
        model_runner,
        capture_bs: Optional[Sequence[int]] = None,
        forward: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
        capture: Optional[GraphCapture] = None,
    ):
        backend = model_runner.backend
        if not backend.supports_cuda_graph:
            raise UnsupportedModeError(
                f"CudaGraphRunner: expected a backend with supports_cuda_graph=True, got "
                f"{backend.name}; use the torch, triton or flashinfer backend"
            )
        self.model_runner = model_runner
        self.forward = forward if forward is not None else model_runner.model
        self.capture_bs = _check_sizes(capture_bs, model_runner.req_to_token_pool.max_reqs)
        self.max_bs = self.capture_bs[-1]
        self.use_cuda = model_runner.device.type == "cuda"
        self._seq_len_fill = backend.get_cuda_graph_seq_len_fill_value()  # padded requests' seq_len
        self.registry = build_decode_registry(self.max_bs, model_runner.device, seq_len_fill_value=self._seq_len_fill)
        backend.init_cuda_graph_state(self.max_bs, self.max_bs)
        self._static: Dict[int, ForwardBatch] = {}  # per size: the batch the graph reads
        self._graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: Dict[int, torch.Tensor] = {}  # per size: hidden [bs, H] in the pool
        self.capture_core = capture if capture is not None else shared_capture(model_runner.device)
        self.capture_seconds = 0.0
        model_runner.step_graphs = self

    # ---- capture ----------------------------------------------------------
    def capture(self, progress: bool = True) -> float:
        """Capture every size, largest first; return the seconds it took."""
        start = time.perf_counter()
        with torch.no_grad():
            for bs in self.capture_core.largest_first(self.capture_bs, "capturing decode graphs", "bs", progress):
                self._capture_one(bs)
        self.capture_seconds = time.perf_counter() - start
        return self.capture_seconds

    def _capture_one(self, bs: int) -> None:
        ctx = FillContext.uniform(0, bs)  # every request is padding
        self.registry.fill_from(self._no_rows(), ctx)
        static = self._static_batch(ctx)
        self.model_runner.backend.init_forward_metadata_capture_cuda_graph(
            bs, bs, static.req_pool_indices, static.seq_lens, None, self.mode, None
        )
        self._static[bs] = static
        counters.graphs_captured += 1
        if not self.use_cuda:
            return
        self.capture_core.warmup(lambda: self._run(static))
        self._graphs[bs], self._outputs[bs] = self.capture_core.record(lambda: self._run(static))

    def _no_rows(self) -> Dict[str, torch.Tensor]:
        """Sources of a fill with no real request: zero rows of every slot."""
        return {slot.name: slot.buffer[:0] for slot in self.registry if slot.copy_from_fb}

    def _static_batch(self, ctx: FillContext) -> ForwardBatch:
        """The batch a graph of ``ctx.padded_bs`` requests reads: registry views."""
        v = self.registry.extract(ctx)
        bs = ctx.padded_bs
        return ForwardBatch(
            forward_mode=self.mode,
            batch_size=bs,
            input_ids=v["input_ids"],
            positions=v["positions"],
            seq_lens=v["seq_lens"],
            seq_lens_cpu=v["seq_lens_cpu"],
            extend_seq_lens=v["extend_seq_lens"],
            # Read by no decode kernel; kept true (seq_len - 1) by _run.
            extend_prefix_lens=torch.empty_like(v["seq_lens"]),
            req_pool_indices=v["req_pool_indices"],
            out_cache_loc=v["out_cache_loc"],
            extend_seq_lens_cpu=[1] * bs,
            extend_prefix_lens_cpu=[],  # host values change per step: not kept here
            num_token_non_padded=v["num_token_non_padded"],
        )

    def _run(self, static: ForwardBatch) -> torch.Tensor:
        """One forward over the static batch: what the graph records."""
        torch.sub(static.seq_lens, static.extend_seq_lens, out=static.extend_prefix_lens)
        with forward_context(static, self.model_runner.backend, check=False):  # padded static batch
            return self.forward(static.input_ids, static.positions)

    # ---- replay -----------------------------------------------------------
    def padded_bs(self, batch: ForwardBatch) -> Optional[int]:
        """The captured size ``batch`` replays at, or None (eager)."""
        if batch.forward_mode != self.mode or not self._static:
            return None
        i = bisect.bisect_left(self.capture_bs, batch.batch_size)
        return self.capture_bs[i] if i < len(self.capture_bs) else None

    def captured_graph(self, bs: int) -> Optional[torch.cuda.CUDAGraph]:
        """The graph captured for ``bs`` requests (None on a CPU or before capture), for profiling."""
        return self._graphs.get(bs)

    def try_replay(self, batch: ForwardBatch) -> Optional[torch.Tensor]:
        """Hidden states ``[num_tokens, H]`` of ``batch`` from a graph, or None
        when no captured graph serves it (the caller runs eagerly; decode
        batches above the largest size are counted)."""
        padded = self.padded_bs(batch)
        if padded is None:
            if batch.forward_mode == self.mode and self._static:
                counters.fallback(
                    f"decode graphs: batch of {batch.batch_size} above the largest captured {self.max_bs}"
                )
            return None
        if batch.batch_size == 0:
            return None  # nothing to run: the eager path handles an empty step
        return self.replay(batch, padded)

    def replay(self, batch: ForwardBatch, padded_bs: int) -> torch.Tensor:
        ctx = FillContext.uniform(batch.batch_size, padded_bs)
        self.registry.fill_from(batch, ctx)
        static = self._static[padded_bs]
        seq_lens_sum = batch.seq_lens_sum + self._seq_len_fill * (padded_bs - batch.batch_size)
        self.model_runner.backend.init_forward_metadata_replay_cuda_graph(
            padded_bs, static.req_pool_indices, static.seq_lens, seq_lens_sum, None, self.mode,
            None, static.seq_lens_cpu,
        )  # fmt: skip
        counters.replays += 1
        if not self.use_cuda:
            return self._run(static)[: batch.num_tokens]
        self._graphs[padded_bs].replay()
        # A copy: the next replay (of any size: one pool) rewrites the graph's output.
        return self._outputs[padded_bs][: batch.num_tokens].clone()


def _check_sizes(capture_bs: Optional[Sequence[int]], max_reqs: int) -> list:
    if capture_bs is None:
        sizes = [s for s in default_capture_sizes(DEFAULT_MAX_DECODE_BS) if s <= max_reqs]
        return sizes or [max_reqs]
    sizes = sorted({check_positive_int("capture_bs", s) for s in capture_bs})
    if not sizes or sizes[-1] > max_reqs:
        raise InvalidInputError(
            f"capture_bs: expected sizes in [1, {max_reqs}] (the request table holds {max_reqs} "
            f"requests), got {list(capture_bs)}"
        )
    return sizes
