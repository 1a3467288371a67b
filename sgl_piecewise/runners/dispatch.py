"""One dispatcher: every ``ModelRunner`` step takes the first path that serves
it (whole-model graphs, then token-axis graphs, else eager) and is counted in
``counters.step_paths[(path, why)]``; the graph policy (``POLICIES``) decides
only what ``capture_graphs`` builds. docs/ARCHITECTURE.md, "The dispatcher".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sgl_piecewise.compile.compiled_model import CompiledModel
from sgl_piecewise.compile.options import DEFAULT_MAX_CAPTURE_SIZE, CompileOptions
from sgl_piecewise.distributed import tensor_parallel
from sgl_piecewise.errors import InvalidInputError, UnsupportedModeError
from sgl_piecewise.forward import ForwardBatch
from sgl_piecewise.runners.breakable import BreakableCudaGraphRunner
from sgl_piecewise.runners.piecewise import PiecewiseCudaGraphRunner
from sgl_piecewise.runners.protocols import GraphHost, StepGraphs, TokenGraphs
from sgl_piecewise.runners.whole_model import CudaGraphRunner

POLICIES = ("auto", "full", "piecewise", "breakable", "none")
logger = logging.getLogger("sgl_piecewise")


def check_policy(graphs: object) -> str:
    if graphs not in POLICIES:
        raise InvalidInputError(f"graphs: expected one of {list(POLICIES)}, got {graphs!r}")
    return graphs  # type: ignore[return-value]


def graph_step(model_runner: GraphHost, batch: ForwardBatch) -> Tuple[Optional[torch.Tensor], str, str]:
    """``(hidden [num_tokens, H], path, why)`` from the first graph runner that
    serves ``batch``; ``(None, "", why none did)`` for the eager path."""
    declined: List[str] = []
    unserved_mode = ""
    whole = model_runner.step_graphs
    if whole is not None:
        hidden, why, usual = _whole_model(whole, batch)
        if hidden is not None:
            return hidden, "whole_model", why
        if usual:  # a mode they never serve: said only if nothing else is
            unserved_mode = why
        else:
            declined.append(why)
    tokens = model_runner.token_graphs
    if tokens is not None:
        n = batch.num_tokens
        padded = tokens.padded_size(n)
        if padded is not None:
            why = f"{batch.forward_mode.name} {n} -> {padded} tokens"
            return tokens.replay(batch, padded), tokens.name, "; ".join([why, *declined])
        declined.append(_token_reason(tokens, batch))
    if whole is None and tokens is None:
        policy = model_runner.graphs
        declined.append(f"graphs={policy!r}" if policy == "none" else f"graphs={policy!r} not captured yet")
    return None, "", "; ".join(declined) or unserved_mode


def _whole_model(runner: StepGraphs, batch: ForwardBatch) -> Tuple[Optional[torch.Tensor], str, bool]:
    """``(hidden or None, why, usual)``; ``usual``: a mode it never serves."""
    mode = batch.forward_mode
    # try_replay whatever padded_bs says: the runner counts its own declines.
    hidden = runner.try_replay(batch)
    padded = runner.padded_bs(batch)
    if hidden is not None:
        return hidden, f"{mode.name} bs {batch.batch_size} -> {padded}", False
    if padded is not None:
        return None, f"{mode.name} bs {batch.batch_size}: declined", False
    if mode not in runner.modes:
        return None, f"{mode.name}: no whole-model graph for this mode", True
    if batch.batch_size > runner.max_bs:
        return None, f"{mode.name} bs above the largest whole-model graph {runner.max_bs}", False
    return None, "whole-model graphs not captured", False


def _token_reason(runner: TokenGraphs, batch: ForwardBatch) -> str:
    mode, n = batch.forward_mode.name, batch.num_tokens
    if n < 1:
        return f"{mode}: no tokens"
    if n > runner.max_size:
        return f"{mode} above the largest {runner.name} size {runner.max_size}"
    return f"{runner.name} graphs not captured"


@dataclass
class CaptureReport:
    """What ``capture_graphs`` built for a policy: per path, what it captured or why not."""

    policy: str
    seconds: float = 0.0
    paths: Dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"graphs={self.policy!r}: captured in {self.seconds:.1f} s"]
        lines += [f"  {path}: {what}" for path, what in self.paths.items()]
        return "\n".join(lines)


def capture_graphs(
    model_runner: GraphHost,
    *,
    progress: bool = True,
    capture_bs: Optional[Sequence[int]] = None,
    capture_sizes: Optional[Sequence[int]] = None,
    piece_compiler: str = "inductor",
) -> CaptureReport:
    """Build the runners the policy ``model_runner.graphs`` needs and hand each
    to ``model_runner.use_graphs``, which captures and installs it."""
    policy = model_runner.graphs
    report = CaptureReport(policy)
    start = time.perf_counter()
    sizes = _token_sizes(model_runner, capture_sizes)
    traced = None  # does the model trace as one graph? None: not tried
    if policy in ("auto", "piecewise"):
        traced = _try_piecewise(model_runner, sizes, piece_compiler, progress, report, required=policy == "piecewise")
    if policy == "breakable" or traced is False:
        _capture_breakable(model_runner, sizes, progress, report)
    if policy in ("auto", "full"):
        _capture_whole_model(model_runner, capture_bs, piece_compiler if traced else None, progress, report)
    report.seconds = time.perf_counter() - start
    logger.info("%s", report)
    return report


def _token_sizes(model_runner: GraphHost, capture_sizes: Optional[Sequence[int]]) -> Tuple[int, ...]:
    """Default: the piecewise schedule, up to what one step can hold."""
    if capture_sizes is not None:
        return CompileOptions(capture_sizes=tuple(capture_sizes)).capture_sizes
    most = model_runner.req_to_token_pool.max_reqs * model_runner.max_context_len
    return CompileOptions(max_capture_size=min(DEFAULT_MAX_CAPTURE_SIZE, most)).capture_sizes


def _describe(sizes: Sequence[int], unit: str) -> str:
    return f"{len(sizes)} sizes, {unit} {sizes[0]}..{sizes[-1]}"


def _try_piecewise(
    model_runner: GraphHost, sizes, piece_compiler: str, progress: bool, report: CaptureReport, *, required: bool
) -> bool:
    """Capture piecewise graphs; False where the model does not trace as one
    graph and ``required`` is off (auto then takes breakable graphs)."""
    options = CompileOptions(cudagraphs=True, capture_sizes=sizes, piece_compiler=piece_compiler)
    runner = PiecewiseCudaGraphRunner(model_runner, options)
    try:  # a refused capture installs nothing
        model_runner.use_graphs(runner, progress=progress)
    except UnsupportedModeError as exc:
        if required:
            raise
        report.paths["piecewise"] = f"refused: {exc}"
        logger.warning("graphs='auto': no piecewise graphs, breakable ones instead: %s", exc)
        return False
    report.paths["piecewise"] = _describe(sizes, "tokens")
    return True


def _capture_breakable(model_runner: GraphHost, sizes, progress: bool, report) -> None:
    model_runner.use_graphs(BreakableCudaGraphRunner(model_runner, sizes), progress=progress)
    report.paths["breakable"] = _describe(sizes, "tokens")


def _capture_whole_model(
    model_runner: GraphHost, capture_bs, piece_compiler: Optional[str], progress: bool, report: CaptureReport
) -> None:
    """Whole-model graphs of the compiled model (``piece_compiler`` given: the
    model traces) or of the eager one; skipped under auto without graph hooks."""
    backend = model_runner.backend
    if not backend.supports_cuda_graph and model_runner.graphs == "auto":
        report.paths["whole_model"] = f"skipped: the {backend.name} backend has no graph hooks"
        logger.info("graphs='auto': %s", report.paths["whole_model"])
        return
    forward = _compiled_forward(model_runner, piece_compiler) if piece_compiler else None
    # Under sequence parallelism each graph's tokens split evenly over the ranks.
    split = token_split()
    rank = tensor_parallel().rank if split > 1 else 0
    bs = capture_bs or None  # None: default_capture_bs, whose sizes split over the ranks
    runner = CudaGraphRunner(model_runner, bs, forward=forward, attn_tp_size=split, attn_tp_rank=rank)
    model_runner.use_graphs(runner, progress=progress)
    what = "compiled" if forward is not None else "eager"
    report.paths["whole_model"] = f"{_describe(runner.capture_bs, 'bs')}, the {what} model"


def token_split() -> int:
    """What a whole-model graph's batch size must be a multiple of: the group's
    size under sequence parallelism, else 1."""
    tp = tensor_parallel()
    return tp.size if tp.splits_sequence else 1


def _compiled_forward(model_runner: GraphHost, piece_compiler: str) -> CompiledModel:
    """The model compiled without graphs of its own, for the whole-model graphs to record."""
    return CompiledModel(model_runner.model, CompileOptions(piece_compiler=piece_compiler))
