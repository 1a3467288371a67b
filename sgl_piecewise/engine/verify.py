"""``verify``: graph replay against eager on fresh random ragged batches.

An eager ``ModelRunner`` and one per graph policy (default ``auto`` and
``breakable``) share one model; the graph runners capture what their policy
needs, and every step goes through the dispatcher, so each path a policy
offers runs: piecewise graphs for EXTEND and MIXED, whole-model graphs for
DECODE (``auto``); breakable graphs for every mode; and eager for the steps
no graph holds. Each step draws a batch — a random size, skewed prefixes
(empty, one token, long), ragged new tokens for EXTEND, prefill chunks next
to single decode tokens for MIXED, now and then one request more than the
largest decode graph — lays it out identically in every runner's pools
(same seed: same rows, slots and token ids), has the model write the
prefixes' K/V with one eager EXTEND over random prefix tokens (eager in
every runner: bit-identical prefixes), runs the step and compares the
logits. Prefixes the model wrote itself keep a real model's attention in
the range it was trained for: random K/V there amplify rounding noise until
a correct graph and eager disagree in bf16. Reports are per (mode, path
taken). The debugging entry (docs/ARCHITECTURE.md, "Debugging").
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

# |graph - eager| <= atol + rtol * |eager| on the logits. Graphs run the
# compiled pieces (Inductor fusions), eager runs the model's own kernels: in
# bf16 that reorders roundings (max |Δ| 0.1-0.16 on logits of ~10, measured).
# The prefixes are K/V the model wrote itself (``model_written_batch``): random
# ones sent a real model's bf16 logits (SmolLM2-135M, 30 layers) 15-20 apart
# on correct graphs, rounding noise no tolerance separates from a bug.
TOLERANCE = {torch.float32: (1e-3, 1e-3), torch.float16: (5e-2, 5e-2), torch.bfloat16: (5e-2, 5e-2)}
# In half precision the rounding itself is the model's: a deep model with
# large activations moves its bf16 logits by several units from its own fp32
# logits (SmolLM2-135M: 0.6-2.8 between compiled and eager kernels, on a CPU
# as on an H200). Each step also runs an fp32 copy of the model, eagerly, and
# a graph path may differ from eager by NOISE_FACTOR times eager's own
# distance from it on that step: two paths each that far from the fp32
# logits are at most twice that far apart.
NOISE_FACTOR = 2.0
MAX_NEW_TOKENS_PER_EXTEND = 16
MODES = (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED)
DEFAULT_POLICIES = ("auto", "breakable")


@dataclass
class PathReport:
    """What ``verify`` saw for one forward mode on one path."""

    mode: str
    path: str  # whole_model, piecewise, breakable or eager (no graph held the step)
    steps: int = 0
    worst: float = 0.0  # max |graph - eager| over every logit
    worst_excess: float = float("-inf")  # max (|Δ| - tolerance): > 0 is a failure
    sizes: List[int] = field(default_factory=list)
    noise: float = 0.0  # max |eager - fp32 copy| (half precision only): the tolerance's third term

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

    ``backend`` builds the attention backend of each runner. Whole-model
    graphs cover batch sizes up to ``max_bs``; token-axis graphs, token
    counts up to ``max_bs * MAX_NEW_TOKENS_PER_EXTEND``.
    """
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
    """An eager runner over an fp32 copy of ``model`` (the graph-safe torch
    backend, which takes any dtype): the logits half precision rounds."""
    heads, _ = attention_heads(model)
    twin = copy.deepcopy(model).float()
    return ModelRunner(twin, max_reqs=max_bs + 1, max_context_len=max_context_len,
                       backend=lambda table, pool: create_backend("torch", table, pool, num_q_heads=heads))  # fmt: skip


def _runners(model, backend, graphs, max_bs: int, max_context_len: int, piece_compiler: str):
    """An eager runner and one captured runner per policy."""
    # One request more than the largest decode graph: the other paths run too.
    kwargs = dict(max_reqs=max_bs + 1, max_context_len=max_context_len, backend=backend)
    eager = ModelRunner(model, **kwargs)
    runners = []
    decode_bs = [bs for bs in default_capture_sizes(max_bs) if bs % token_split() == 0]
    for policy in graphs:
        runner = ModelRunner(model, graphs=policy, **kwargs)
        runner.capture_graphs(progress=False, capture_bs=decode_bs,
                              capture_sizes=default_capture_sizes(max_bs * MAX_NEW_TOKENS_PER_EXTEND),
                              piece_compiler=piece_compiler)  # fmt: skip
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
    # Skewed prefixes: empty, one token, or long (up to what the context holds).
    prefix = [rng.choice((0, 1, rng.randint(2, max_context_len - e))) for e in extend]
    return mode, prefix, extend


def _step(runner: ModelRunner, mode: ForwardMode, prefix, extend, seed: int) -> torch.Tensor:
    """The step's logits on ``runner``; its prefixes are prefilled by the
    runner's eager model (never its graphs), so every runner starts alike."""
    gen = torch.Generator().manual_seed(seed)
    batch = model_written_batch(mode, runner.req_to_token_pool, runner.kv_pool, runner.model, runner.backend,
                                prefix, extend, vocab_size=runner.config.vocab_size, generator=gen)  # fmt: skip
    try:
        return runner.forward_step(batch).float()
    finally:
        release_batch(runner.req_to_token_pool, runner.kv_pool, batch)
