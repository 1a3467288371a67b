"""Plain greedy against greedy speculative decoding on one batch: the
measurement behind ``sgl-piecewise bench --draft SPEC`` and
``benchmarks/bench_speculative.py``.

Both runs use one target ``ModelRunner``; with a graph-capable backend the
target gets whole-model graphs for DECODE (plain greedy) and TARGET_VERIFY,
the draft for DECODE and DRAFT_EXTEND_V2 (``k + 1`` tokens per request).
Prefills run eagerly in both. Each run is warmed up (kernel JIT, allocator)
before it is timed; tokens per second count every generated token of the
batch over the run's wall time.
"""

from __future__ import annotations

import argparse
import time
from typing import Dict, List, Optional, Sequence

import torch
from rich.table import Table

from sgl_piecewise.backends.factory import get_backend_class
from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.compile.options import default_capture_sizes
from sgl_piecewise.engine.bench import backend_factory, check_backend, load_model, ragged_prompts
from sgl_piecewise.engine.drafts import DRAFT_SPELLING, DraftSpec, build_draft_model, parse_draft_spec
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.engine.speculative import speculative_generate
from sgl_piecewise.forward import ForwardMode
from sgl_piecewise.graphs.counters import counters
from sgl_piecewise.runners.whole_model import CudaGraphRunner


def compare_greedy_and_speculative(
    model: torch.nn.Module,
    spec: DraftSpec,
    prompts: List[List[int]],
    new_tokens: int,
    backend,
    graphs: bool = True,
    capture_bs: Optional[Sequence[int]] = None,
    progress: bool = False,
) -> Dict[str, object]:
    """Time plain greedy and speculative decoding of ``prompts`` (``new_tokens``
    each) with the draft ``spec`` names; ``backend``: a name or a factory."""
    k = spec.num_draft_tokens
    context = min(max(map(len, prompts)) + new_tokens + k, model.config.max_position_embeddings)
    kwargs = dict(max_reqs=len(prompts), max_context_len=context, backend=backend)
    target = ModelRunner(model, **kwargs)
    draft = ModelRunner(build_draft_model(spec, model), **kwargs)
    if graphs:
        # SGLang's sizes below the batch, and the batch itself: no step falls back.
        n = len(prompts)
        capture_bs = capture_bs or sorted({*default_capture_sizes(n), n})
        CudaGraphRunner(target, capture_bs, modes=[ForwardMode.DECODE, ForwardMode.TARGET_VERIFY],
                        num_tokens_per_req=k + 1).capture(progress)  # fmt: skip
        CudaGraphRunner(draft, capture_bs, modes=[ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND_V2],
                        num_tokens_per_req=k + 1).capture(progress)  # fmt: skip
    target.generate(prompts, min(new_tokens, 2))  # warm-up, untimed
    speculative_generate(target, draft, prompts, min(new_tokens, k + 2), k)
    counters.reset()
    start = time.perf_counter()
    plain = target.generate(prompts, new_tokens)
    plain_s = time.perf_counter() - start
    start = time.perf_counter()
    out = speculative_generate(target, draft, prompts, new_tokens, k)
    spec_s = time.perf_counter() - start
    generated = len(prompts) * new_tokens
    return {
        "draft": str(spec),
        "num_draft_tokens": k,
        "graphs": graphs,
        "plain_tokens_per_s": generated / plain_s,
        "speculative_tokens_per_s": generated / spec_s,
        "speedup": plain_s / spec_s,
        "acceptance_rate": out.stats.acceptance_rate,
        "verify_steps": out.stats.rounds,
        "plain_decode_steps": new_tokens - 1,
        "identical_tokens": out.tokens == plain,
        "eager_fallbacks": dict(counters.eager_fallbacks),
    }


# ---- the command line: sgl-piecewise bench --draft SPEC ------------------------------
def add_draft_argument(bench: argparse.ArgumentParser) -> None:
    bench.add_argument(
        "--draft",
        default=None,
        help=f"compare plain greedy with speculative decoding instead of the --modes: {DRAFT_SPELLING}; "
        "self = the target itself, self-layers = its first N layers, random = an unrelated model",
    )


def bench_draft(args: argparse.Namespace, console) -> int:
    """``bench --draft``: one table row per run; 1 when float32 runs differ.
    Prompts, backend and device come as for the other bench modes."""
    for name in ("batch_size", "prompt_len", "new_tokens"):
        check_positive_int(f"--{name.replace('_', '-')}", getattr(args, name))
    spec = parse_draft_spec(args.draft)  # before the model loads
    check_backend(args.backend, [])
    graphs = get_backend_class(args.backend).supports_cuda_graph
    device, dtype, model = load_model(args)
    prompts = ragged_prompts(args.batch_size, args.prompt_len, model.config.vocab_size, args.seed)
    console.print(
        f"model: {args.model or 'embedded default (random weights)'} | draft {spec} | device {device} | {dtype} | "
        f"backend {args.backend} | whole-model graphs {'on' if graphs else 'off (no graph hooks)'} | "
        f"batch {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens"
    )
    r = compare_greedy_and_speculative(model, spec, prompts, args.new_tokens, backend_factory(args.backend, model),
                                       graphs=graphs)  # fmt: skip
    table = Table(title=f"sgl-piecewise bench --draft {spec}")
    for col in ("run", "tokens/s", "speed-up", "acceptance rate", "target steps"):
        table.add_column(col, justify="left" if col == "run" else "right")
    table.add_row("plain greedy", f"{r['plain_tokens_per_s']:.1f}", "1.00x", "-", str(r["plain_decode_steps"]))
    table.add_row("speculative", f"{r['speculative_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
                  f"{r['acceptance_rate']:.2f}", str(r["verify_steps"]))  # fmt: skip
    console.print(table)
    console.print("target steps: after the prefill, decode steps (plain) or verify steps (speculative)")
    if not r["identical_tokens"] and dtype == torch.float32:
        console.print("[red]check failed: float32 speculative decoding must give plain greedy's tokens[/red]")
        return 1
    same = "identical tokens" if r["identical_tokens"] else "tokens differ (expected in reduced precision)"
    console.print(f"check: {same}; eager fallbacks: {r['eager_fallbacks'] or 'none'}")
    return 0
