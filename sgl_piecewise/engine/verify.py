"""``verify``: graph replay against eager on fresh random ragged batches.

An eager ``ModelRunner`` and one per graph policy share one model; each step
draws a batch (random size, skewed prefixes the model writes itself, now and
then one request above the largest decode graph), lays it out alike in every
runner and compares the logits, reported per (mode, path taken).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from tqdm.auto import tqdm

from sgl_piecewise.backends.base import AttentionBackend
from sgl_piecewise.backends.factory import create_backend
from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.compile.options import default_capture_sizes
from sgl_piecewise.engine.runner import ModelRunner, attention_heads
from sgl_piecewise.engine.testing import model_written_batch, release_batch
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.forward import ForwardMode
from sgl_piecewise.memory import KVPool, ReqToTokenPool
from sgl_piecewise.runners.dispatch import POLICIES, token_split

# |graph - eager| <= atol + rtol * |eager| on the logits: compiled kernels round otherwise in half precision.
TOLERANCE = {torch.float32: (1e-3, 1e-3), torch.float16: (5e-2, 5e-2), torch.bfloat16: (5e-2, 5e-2)}
# In half precision a deep model's own rounding moves its logits by whole units,
# so a graph path may also differ from eager by NOISE_FACTOR times eager's
# distance from an fp32 copy on that step (two paths that far from it are at
# most twice that far apart).
NOISE_FACTOR = 2.0
MAX_NEW_TOKENS_PER_EXTEND = 16
MODES = (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED)
DEFAULT_POLICIES = ("auto", "breakable")


@dataclass
class PathReport:
    """What ``verify`` saw for one forward mode on one path."""

    mode: str
    path: str  # whole_model, piecewise, breakable or eager
    steps: int = 0
    worst: float = 0.0  # max |graph - eager| over every logit
    worst_excess: float = float("-inf")  # max (|Δ| - tolerance): > 0 is a failure
    sizes: List[int] = field(default_factory=list)
    noise: float = 0.0  # max |eager - fp32 copy| (half precision only)

    @property
    def ok(self) -> bool:
        return self.worst_excess <= 0


def verify(
    model: torch.nn.Module,
    backend: Callable[[ReqToTokenPool, KVPool], AttentionBackend],
    *,
    graphs: Sequence[str] = DEFAULT_POLICIES,
    steps: int = 24,
    max_bs: int = 8,
    max_context_len: int = 256,
    seed: int = 0,
    piece_compiler: str = "inductor",
    progress: bool = True,
) -> Dict[Tuple[str, str], PathReport]:
    """Replay against eager for ``steps`` random steps; one report per (mode, path).
    Whole-model graphs cover batch sizes up to ``max_bs``, token-axis graphs
    ``max_bs * MAX_NEW_TOKENS_PER_EXTEND`` tokens."""
    check_positive_int("steps", steps)
    check_positive_int("max_bs", max_bs)
    if check_positive_int("max_context_len", max_context_len) < MAX_NEW_TOKENS_PER_EXTEND + 2:
        raise InvalidInputError(
            f"max_context_len: expected at least {MAX_NEW_TOKENS_PER_EXTEND + 2} (a long prefix "
            f"and {MAX_NEW_TOKENS_PER_EXTEND} new tokens), got {max_context_len}"
        )
    bad = [g for g in graphs if g not in POLICIES or g == "none"]
    if bad or not graphs:
        raise InvalidInputError(f"graphs: expected policies among {list(POLICIES[:-1])}, got {list(graphs)}")
    eager, runners = _runners(model, backend, graphs, max_bs, max_context_len, piece_compiler)
    reference = _fp32_reference(model, max_bs, max_context_len) if eager.dtype != torch.float32 else None
    reports: Dict[Tuple[str, str], PathReport] = {}
    rng = random.Random(seed)
    atol, rtol = TOLERANCE.get(eager.dtype, TOLERANCE[torch.float32])
    for _ in tqdm(range(steps), desc="verify", disable=not progress, unit="step"):
        mode, prefix, extend = _draw_step(rng, max_bs, max_context_len)
        step_seed = rng.randrange(2**31)
        want = _step(eager, mode, prefix, extend, step_seed)
        noise = (
            0.0 if reference is None else float((want - _step(reference, mode, prefix, extend, step_seed)).abs().max())
        )
        for runner in runners:
            diff = (_step(runner, mode, prefix, extend, step_seed) - want).abs()
            path = runner.step_stats[-1].path
            report = reports.setdefault((mode.name, path), PathReport(mode.name, path))
            report.steps += 1
            report.sizes.append(len(prefix))
            report.worst = max(report.worst, float(diff.max()))
            report.noise = max(report.noise, noise)
            allowed = atol + rtol * want.abs() + NOISE_FACTOR * noise
            report.worst_excess = max(report.worst_excess, float((diff - allowed).max()))
    return reports


def _fp32_reference(model: torch.nn.Module, max_bs: int, max_context_len: int) -> ModelRunner:
    """An eager runner over an fp32 copy of ``model`` (the torch backend takes any dtype)."""
    heads, _ = attention_heads(model)
    twin = copy.deepcopy(model).float()
    return ModelRunner(
        twin,
        max_reqs=max_bs + 1,
        max_context_len=max_context_len,
        backend=lambda table, pool: create_backend("torch", table, pool, num_q_heads=heads),
    )


def _runners(model, backend, graphs, max_bs: int, max_context_len: int, piece_compiler: str):
    """An eager runner and one captured runner per policy, with room for one
    request more than the largest decode graph."""
    kwargs = dict(max_reqs=max_bs + 1, max_context_len=max_context_len, backend=backend)
    eager = ModelRunner(model, **kwargs)
    runners = []
    decode_bs = [bs for bs in default_capture_sizes(max_bs) if bs % token_split() == 0]
    for policy in graphs:
        runner = ModelRunner(model, graphs=policy, **kwargs)
        runner.capture_graphs(
            progress=False,
            capture_bs=decode_bs,
            capture_sizes=default_capture_sizes(max_bs * MAX_NEW_TOKENS_PER_EXTEND),
            piece_compiler=piece_compiler,
        )
        runners.append(runner)
    return eager, runners


def _draw_step(rng: random.Random, max_bs: int, max_context_len: int):
    mode = rng.choice(MODES)
    bs = max_bs + 1 if rng.random() < 0.1 else rng.randint(1, max_bs)
    if mode == ForwardMode.DECODE:
        extend = [1] * bs
    else:  # MIXED: about half the requests decode (one new token), the others prefill a chunk
        one = 0.5 if mode == ForwardMode.MIXED else 0.0
        extend = [1 if rng.random() < one else rng.randint(1, MAX_NEW_TOKENS_PER_EXTEND) for _ in range(bs)]
    prefix = [rng.choice((0, 1, rng.randint(2, max_context_len - e))) for e in extend]
    return mode, prefix, extend


def _step(runner: ModelRunner, mode: ForwardMode, prefix, extend, seed: int) -> torch.Tensor:
    """The step's logits on ``runner``, its prefixes prefilled eagerly."""
    gen = torch.Generator().manual_seed(seed)
    batch = model_written_batch(
        mode,
        runner.req_to_token_pool,
        runner.kv_pool,
        runner.model,
        runner.backend,
        prefix,
        extend,
        vocab_size=runner.config.vocab_size,
        generator=gen,
    )
    try:
        return runner.forward_step(batch).float()
    finally:
        release_batch(runner.req_to_token_pool, runner.kv_pool, batch)
