"""``verify``: graph replay against eager on fresh random ragged batches.

Two ``ModelRunner`` s share one model: one runs every step eagerly, the other
through the graph runners (piecewise graphs for EXTEND, whole-model graphs
for DECODE). Each step draws a batch — a random size, skewed prefixes (empty,
one token, long), ragged new tokens for EXTEND, now and then one request more
than the largest decode graph so the eager fallback runs too — lays it out
identically in both runners' pools (same seed: same random K/V prefixes) and
compares the logits. The debugging entry (docs/ARCHITECTURE.md, "Debugging").
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import torch
from tqdm.auto import tqdm

from sgl_piecewise.backends.base import AttentionBackend
from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.compile.counters import counters
from sgl_piecewise.compile.options import CompileOptions, default_capture_sizes
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.forward import ForwardMode
from sgl_piecewise.memory import KVPool, ReqToTokenPool
from sgl_piecewise.runner import ModelRunner
from sgl_piecewise.runners.piecewise import PiecewiseCudaGraphRunner
from sgl_piecewise.runners.whole_model import CudaGraphRunner
from sgl_piecewise.testing import random_batch, release_batch

# |graph - eager| <= atol + rtol * |eager| on the logits. Graphs run the
# compiled pieces (Inductor fusions), eager runs the model's own kernels: in
# bf16 that reorders roundings (max |Δ| 0.1-0.16 on logits of ~10, measured).
TOLERANCE = {torch.float32: (1e-3, 1e-3), torch.float16: (5e-2, 5e-2), torch.bfloat16: (5e-2, 5e-2)}
MAX_NEW_TOKENS_PER_EXTEND = 16


@dataclass
class ModeReport:
    """What ``verify`` saw for one forward mode."""

    mode: str
    steps: int = 0
    worst: float = 0.0  # max |graph - eager| over every logit
    worst_excess: float = float("-inf")  # max (|Δ| - tolerance): > 0 is a failure
    fallbacks: int = 0  # steps that ran eagerly in the graph runner (counted)
    sizes: List[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.worst_excess <= 0


def verify(
    model: torch.nn.Module,
    backend: Callable[[ReqToTokenPool, KVPool], AttentionBackend],
    *,
    steps: int = 24,
    max_bs: int = 8,
    max_context_len: int = 256,
    seed: int = 0,
    progress: bool = True,
) -> Dict[str, ModeReport]:
    """Replay against eager for ``steps`` random steps; one report per mode.

    ``backend`` builds the attention backend of each runner (it must support
    CUDA graphs). Decode graphs cover batch sizes up to ``max_bs``; prefill
    graphs, token counts up to ``max_bs * MAX_NEW_TOKENS_PER_EXTEND``.
    """
    check_positive_int("steps", steps)
    check_positive_int("max_bs", max_bs)
    if check_positive_int("max_context_len", max_context_len) < MAX_NEW_TOKENS_PER_EXTEND + 2:
        raise InvalidInputError(
            f"max_context_len: expected at least {MAX_NEW_TOKENS_PER_EXTEND + 2} (a long prefix "
            f"and {MAX_NEW_TOKENS_PER_EXTEND} new tokens), got {max_context_len}"
        )
    eager, graphs = _twin_runners(model, backend, max_bs, max_context_len)
    reports = {m.name: ModeReport(m.name) for m in (ForwardMode.EXTEND, ForwardMode.DECODE)}
    rng = random.Random(seed)
    atol, rtol = TOLERANCE.get(graphs.dtype, TOLERANCE[torch.float32])
    for _ in tqdm(range(steps), desc="verify", disable=not progress, unit="step"):
        mode, prefix, extend = _draw_step(rng, max_bs, max_context_len)
        step_seed = rng.randrange(2**31)
        fallbacks = sum(counters.eager_fallbacks.values())
        want, got = (_step(r, mode, prefix, extend, step_seed) for r in (eager, graphs))
        diff = (got - want).abs()
        report = reports[mode.name]
        report.steps += 1
        report.sizes.append(len(prefix))
        report.worst = max(report.worst, float(diff.max()))
        report.worst_excess = max(report.worst_excess, float((diff - atol - rtol * want.abs()).max()))
        report.fallbacks += sum(counters.eager_fallbacks.values()) - fallbacks
    return reports


def _twin_runners(model, backend, max_bs: int, max_context_len: int) -> Tuple[ModelRunner, ModelRunner]:
    # One request more than the largest decode graph: the fallback path runs too.
    kwargs = dict(max_reqs=max_bs + 1, max_context_len=max_context_len, backend=backend)
    eager, graphs = ModelRunner(model, **kwargs), ModelRunner(model, **kwargs)
    max_tokens = max_bs * MAX_NEW_TOKENS_PER_EXTEND
    PiecewiseCudaGraphRunner(graphs, CompileOptions(cudagraphs=True, max_capture_size=max_tokens)).capture(False)
    CudaGraphRunner(graphs, default_capture_sizes(max_bs)).capture(progress=False)
    return eager, graphs


def _draw_step(rng: random.Random, max_bs: int, max_context_len: int):
    mode = rng.choice((ForwardMode.EXTEND, ForwardMode.DECODE))
    bs = max_bs + 1 if rng.random() < 0.1 else rng.randint(1, max_bs)
    if mode == ForwardMode.DECODE:
        extend = [1] * bs
    else:
        extend = [rng.randint(1, MAX_NEW_TOKENS_PER_EXTEND) for _ in range(bs)]
    # Skewed prefixes: empty, one token, or long (up to what the context holds).
    prefix = [rng.choice((0, 1, rng.randint(2, max_context_len - e))) for e in extend]
    return mode, prefix, extend


def _step(runner: ModelRunner, mode: ForwardMode, prefix, extend, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    batch = random_batch(mode, runner.req_to_token_pool, runner.kv_pool, prefix, extend,
                         vocab_size=runner.config.vocab_size, generator=gen)  # fmt: skip
    try:
        return runner.forward_step(batch).float()
    finally:
        release_batch(runner.req_to_token_pool, runner.kv_pool, batch)
