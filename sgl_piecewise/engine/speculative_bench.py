"""Plain greedy against greedy speculative decoding on one batch, each warmed
up, then timed: ``sgl-piecewise bench --draft SPEC`` and
``benchmarks/bench_speculative.py``. With graphs, the target's DECODE and
TARGET_VERIFY steps and the draft's DECODE and DRAFT_EXTEND_V2 steps replay
whole-model graphs.
"""

from __future__ import annotations

import argparse
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from rich.table import Table

from sgl_piecewise.backends.factory import get_backend_class
from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.compile.options import default_capture_sizes
from sgl_piecewise.engine.bench import (
    backend_factory,
    check_backend,
    load_model,
    parse_policies,
    ragged_prompts,
    resolve_device_dtype,
    tp_title,
)
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
    """Time plain greedy and speculative decoding of ``prompts``; ``backend``: a name or a factory."""
    k = spec.num_draft_tokens
    context = min(max(map(len, prompts)) + new_tokens + k, model.config.max_position_embeddings)
    kwargs = dict(max_reqs=len(prompts), max_context_len=context, backend=backend)
    target = ModelRunner(model, **kwargs)
    draft = ModelRunner(build_draft_model(spec, model), **kwargs)
    if graphs:
        n = len(prompts)  # the batch itself is a size too: no step falls back
        capture_bs = capture_bs or sorted({*default_capture_sizes(n), n})
        verify = [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY]
        target.use_graphs(
            CudaGraphRunner(target, capture_bs, modes=verify, num_tokens_per_req=k + 1), progress=progress
        )
        extend = [ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND_V2]
        draft.use_graphs(CudaGraphRunner(draft, capture_bs, modes=extend, num_tokens_per_req=k + 1), progress=progress)
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


# The speculative runs have whole-model graphs (full) or none.
DRAFT_POLICIES = ("full", "none")
WHOLE_MODEL_GRAPHS = {"full": "on", "none": "off"}


def add_draft_argument(bench: argparse.ArgumentParser) -> None:
    bench.add_argument(
        "--draft",
        default=None,
        help=f"compare plain greedy with speculative decoding instead of the graph policies: {DRAFT_SPELLING}; "
        "self = the target itself, self-layers = its first N layers, random = an unrelated model; "
        f"--graphs then among {', '.join(DRAFT_POLICIES)} (default: full where the backend has graph hooks)",
    )


def draft_policies(args: argparse.Namespace) -> List[str]:
    """``--graphs`` of ``bench --draft``; default full where the backend has graph hooks, else none."""
    check_backend(args.backend, [])
    if args.graphs is None:
        return ["full" if get_backend_class(args.backend).supports_cuda_graph else "none"]
    policies = parse_policies(args.graphs, DRAFT_POLICIES, flag="--graphs with --draft")
    check_backend(args.backend, policies)
    return policies


def check_draft_flags(args: argparse.Namespace) -> Tuple[DraftSpec, List[str]]:
    """Every flag of ``bench --draft`` that can be checked without the model."""
    for name in ("batch_size", "prompt_len", "new_tokens"):
        check_positive_int(f"--{name.replace('_', '-')}", getattr(args, name))
    spec = parse_draft_spec(args.draft)
    policies = draft_policies(args)
    resolve_device_dtype(args.device, args.dtype)
    return spec, policies


def bench_draft(args: argparse.Namespace, console) -> int:
    """``bench --draft``: a plain and a speculative row per graph policy; 1 when float32 runs differ."""
    spec, policies = check_draft_flags(args)
    device, dtype, model = load_model(args)
    prompts = ragged_prompts(args.batch_size, args.prompt_len, model.config.vocab_size, args.seed)
    graphs = ", then ".join(WHOLE_MODEL_GRAPHS[p] for p in policies)
    why = " (no graph hooks)" if args.graphs is None and policies == ["none"] else ""
    console.print(
        f"model: {args.model or 'embedded default (random weights)'} | draft {spec} | device {device} | {dtype} | "
        f"backend {args.backend} | whole-model graphs {graphs}{why} | "
        f"batch {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens"
    )
    runs = {
        p: compare_greedy_and_speculative(
            model, spec, prompts, args.new_tokens, backend_factory(args.backend, model), graphs=p == "full"
        )
        for p in policies
    }
    console.print(_draft_table(spec, runs))
    console.print("target steps: after the prefill, decode steps (plain) or verify steps (speculative)")
    failed = False
    for policy, r in runs.items():
        failed |= _check_draft(policy if len(runs) > 1 else "", r, dtype, console)
    return 1 if failed else 0


def _draft_table(spec: DraftSpec, runs: Dict[str, Dict[str, object]]) -> Table:
    table = Table(title=tp_title(f"sgl-piecewise bench --draft {spec}"))
    for col in ("graphs", "run", "tokens/s", "speed-up", "acceptance rate", "target steps"):
        table.add_column(col, justify="left" if col in ("graphs", "run") else "right")
    for policy, r in runs.items():
        table.add_row(
            policy, "plain greedy", f"{r['plain_tokens_per_s']:.1f}", "1.00x", "-", str(r["plain_decode_steps"])
        )
        table.add_row(
            policy,
            "speculative",
            f"{r['speculative_tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}x",
            f"{r['acceptance_rate']:.2f}",
            str(r["verify_steps"]),
        )
    return table


def _check_draft(policy: str, r: Dict[str, object], dtype: torch.dtype, console) -> bool:
    """Print the check of one run; True where float32 tokens differ."""
    label = f"graphs {policy}: " if policy else ""
    if not r["identical_tokens"] and dtype == torch.float32:
        console.print(f"[red]{label}check failed: float32 speculative decoding must give plain greedy's tokens[/red]")
        return True
    same = "identical tokens" if r["identical_tokens"] else "tokens differ (expected in reduced precision)"
    console.print(f"{label}check: {same}; eager fallbacks: {r['eager_fallbacks'] or 'none'}")
    return False
