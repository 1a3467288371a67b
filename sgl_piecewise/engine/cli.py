"""``sgl-piecewise`` (also ``python -m sgl_piecewise``): the command-line main job.

``sgl-piecewise bench`` runs one ragged batch of prompts through the same model
under each graph policy (``--graphs``: ``none`` eager, ``full`` whole-model
decode graphs, ``piecewise``, ``breakable``, ``auto`` — see
``runners/dispatch.py``), checks that they produce the same tokens, and prints
a table of set-up time, prefill time, decode step time and the path the steps
took. On a CPU the graph capture is a pass-through (everything else runs as on
a GPU). With ``--draft``, bench compares plain greedy decoding with
speculative decoding instead (``speculative_bench.py``).

``sgl-piecewise verify`` replays the graphs of each policy against eager on
fresh random ragged batches (``sgl_piecewise.engine.verify``) and exits non-zero on a
mismatch.
"""

from __future__ import annotations

import argparse
import collections
import logging
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from sgl_piecewise.runners.dispatch import POLICIES

BENCH_POLICIES = ("none", "full", "piecewise", "breakable", "auto")  # the table's order: eager first
VERIFY_POLICIES = ("auto", "breakable")
# Policies that need a backend with graph hooks (auto goes without whole-model graphs).
GRAPH_HOOK_POLICIES = ("full",)
DESCRIPTION = (
    "The CUDA-graph and torch.compile layer of an LLM engine, from the command line: "
    "bench runs one ragged batch under each graph policy and checks the tokens agree; "
    "verify replays graphs against eager on random ragged batches."
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class PolicyResult:
    policy: str
    setup_s: float
    prefill_ms: float
    decode_ms: Optional[float]  # None: no decode step (one new token)
    tokens: List[List[int]]
    paths: str  # how many timed steps took each path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sgl-piecewise", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="one batch under each graph policy: times, paths, tokens agree")
    _add_model_args(b)
    b.add_argument("--batch-size", type=int, default=4)
    b.add_argument("--prompt-len", type=int, default=48, help="longest prompt; prompts are ragged, down to half of it")
    b.add_argument("--new-tokens", type=int, default=16)
    b.add_argument("--graphs", default=",".join(BENCH_POLICIES),
                   help=f"comma-separated graph policies among {POLICIES}, run in that order")  # fmt: skip
    b.add_argument("--max-capture-size", type=int, default=64, help="largest token count captured as graphs")
    _add_draft_argument(b)
    v = sub.add_parser("verify", help="graph replay vs eager on random ragged batches")
    _add_model_args(v)
    v.add_argument("--graphs", default=",".join(VERIFY_POLICIES),
                   help="comma-separated graph policies whose paths are checked (not none)")  # fmt: skip
    v.add_argument("--steps", type=int, default=24)
    v.add_argument("--max-bs", type=int, default=8, help="largest decode graph; prefill graphs up to 16x it tokens")
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """What both commands run on: the model, where, and its attention backend."""
    p.add_argument(
        "--model", default=None, help="local Hugging Face checkpoint dir (default: embedded config, random weights)"
    )
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--backend", default="torch",
                   help="attention backend: torch (graph-safe PyTorch), triton, flashinfer, or reference "
                        "(the oracle; no graph hooks: not for --graphs full)")  # fmt: skip
    p.add_argument("--piece-compiler", default="inductor", choices=["inductor", "eager", "tensorrt"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "-v", "--verbose", action="store_true", help="log what the library decides (KV pool size, fallbacks)"
    )


def _add_draft_argument(p: argparse.ArgumentParser) -> None:
    from sgl_piecewise.engine.speculative_bench import add_draft_argument

    add_draft_argument(p)


def _policies(text: str, allowed: Sequence[str]) -> List[str]:
    """``--graphs``: a comma-separated list among ``allowed``."""
    policies = [g.strip() for g in text.split(",") if g.strip()]
    if not policies or any(g not in allowed for g in policies):
        raise SystemExit(f"--graphs: expected a comma-separated subset of {tuple(allowed)}, got {text!r}")
    return policies


def _check_backend(name: str, policies: Sequence[str]) -> None:
    """Before anything is loaded: the backend exists and has graph hooks if a policy needs them."""
    from sgl_piecewise.backends.factory import backend_names, get_backend_class
    from sgl_piecewise.errors import InvalidInputError

    if name not in backend_names():
        raise InvalidInputError(f"--backend: expected one of {list(backend_names())}, got {name!r}")
    needs = [g for g in policies if g in GRAPH_HOOK_POLICIES]
    if needs and not get_backend_class(name).supports_cuda_graph:
        raise InvalidInputError(
            f"--backend {name}: expected a backend with graph hooks for --graphs {', '.join(needs)}, got one "
            f"without; use torch, triton or flashinfer, or leave {', '.join(needs)} out"
        )


def _backend_factory(name: str, model):
    """``ModelRunner``'s ``backend`` argument: backend ``name`` over the runner's pools."""
    from sgl_piecewise.backends.factory import create_backend

    heads = model.config.num_attention_heads
    return lambda table, pool: create_backend(name, table, pool, num_q_heads=heads)


def _resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: expected a CUDA device, got none; use --device cpu")
    if dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, DTYPES[dtype]


def _load_model(args: argparse.Namespace) -> tuple[torch.device, torch.dtype, Any]:
    """``--device``, ``--dtype`` resolved, and ``--model`` (or the embedded
    default, random weights of ``--seed``) loaded with them."""
    from sgl_piecewise.models.loader import load_model_or_default

    device, dtype = _resolve_device_dtype(args.device, args.dtype)
    return device, dtype, load_model_or_default(args.model, dtype, device, seed=args.seed)


def _prompts(batch_size: int, prompt_len: int, vocab: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    lengths = [rng.randint(max(1, prompt_len // 2), prompt_len) for _ in range(batch_size)]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _run_policy(policy: str, model, args, prompts) -> PolicyResult:
    from sgl_piecewise.compile.options import default_capture_sizes
    from sgl_piecewise.engine.runner import ModelRunner

    context = max(len(p) for p in prompts) + args.new_tokens
    runner = ModelRunner(
        model,
        max_reqs=len(prompts),
        max_context_len=min(max(context, args.max_capture_size), model.config.max_position_embeddings),
        backend=_backend_factory(args.backend, model),
        graphs=policy,
    )
    start = time.perf_counter()
    runner.capture_graphs(progress=True, capture_sizes=default_capture_sizes(args.max_capture_size),
                          piece_compiler=args.piece_compiler)  # fmt: skip
    # Compile, capture and warm up (kernel JIT, allocator) outside the timed run.
    runner.generate(prompts, 2)
    setup = time.perf_counter() - start
    runner.step_stats.clear()
    tokens = runner.generate(prompts, args.new_tokens, progress=args.new_tokens >= 64)
    steps = list(runner.step_stats)
    decode = [s.seconds for s in steps[1:]]
    decode_ms = 1e3 * sum(decode) / len(decode) if decode else None
    paths = ", ".join(f"{path} {n}" for path, n in collections.Counter(s.path for s in steps).items())
    return PolicyResult(policy, setup, steps[0].seconds * 1e3, decode_ms, tokens, paths)


def _agreement(results: Sequence[PolicyResult]) -> List[str]:
    ref = results[0]
    lines = []
    for r in results[1:]:
        same = sum(a == b for ra, rb in zip(ref.tokens, r.tokens) for a, b in zip(ra, rb))
        total = sum(len(t) for t in ref.tokens)
        lines.append(f"{r.policy} vs {ref.policy}: {same}/{total} generated tokens identical")
    return lines


def bench(args: argparse.Namespace, console: Console) -> int:
    from sgl_piecewise.checks import check_positive_int

    if args.draft is not None:
        from sgl_piecewise.engine.speculative_bench import bench_draft

        return bench_draft(args, console)
    for name in ("batch_size", "prompt_len", "new_tokens", "max_capture_size"):
        check_positive_int(f"--{name.replace('_', '-')}", getattr(args, name))
    policies = _policies(args.graphs, POLICIES)
    _check_backend(args.backend, policies)
    device, dtype, model = _load_model(args)
    prompts = _prompts(args.batch_size, args.prompt_len, model.config.vocab_size, args.seed)
    console.print(
        f"model: {args.model or 'embedded default (random weights)'} | {model.config.architecture} | "
        f"{model.config.num_hidden_layers} layers | device {device} | {dtype} | backend {args.backend} | "
        f"batch {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens"
    )
    results = []
    for policy in policies:
        console.print(f"[bold]graphs={policy}[/bold] ...")
        results.append(_run_policy(policy, model, args, prompts))
    table = Table(title="sgl-piecewise bench")
    for col in ("graphs", "set-up s", "prefill ms", "decode ms/step", "speed-up vs first", "steps by path"):
        table.add_column(col, justify="left" if col in ("graphs", "steps by path") else "right", overflow="fold")
    for r in results:
        # --new-tokens 1 has no decode step: nothing to time or compare.
        decode = "-" if r.decode_ms is None else f"{r.decode_ms:.3f}"
        speedup = "-" if r.decode_ms is None else f"{results[0].decode_ms / r.decode_ms:.2f}x"
        table.add_row(r.policy, f"{r.setup_s:.2f}", f"{r.prefill_ms:.2f}", decode, speedup, r.paths)
    console.print(table)
    agree = _agreement(results)
    for line in agree:
        console.print(line)
    mismatched = any(r.tokens != results[0].tokens for r in results[1:])
    if mismatched and dtype == torch.float32:
        console.print("[red]check failed: float32 runs must generate identical tokens[/red]")
        return 1
    console.print("check: " + ("outputs agree" if not mismatched else "tokens differ (expected in reduced precision)"))
    return 0


def verify_command(args: argparse.Namespace, console: Console) -> int:
    from sgl_piecewise.engine.verify import TOLERANCE, verify

    policies = _policies(args.graphs, [g for g in POLICIES if g != "none"])
    _check_backend(args.backend, policies)
    device, dtype, model = _load_model(args)
    reports = verify(
        model,
        _backend_factory(args.backend, model),
        graphs=policies, steps=args.steps, max_bs=args.max_bs, seed=args.seed,
        max_context_len=min(256, model.config.max_position_embeddings), piece_compiler=args.piece_compiler,
    )  # fmt: skip
    atol, rtol = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    table = Table(title=f"sgl-piecewise verify ({device}, {dtype}, backend {args.backend}, "
                        f"graphs {','.join(policies)}, tolerance {atol:g} + {rtol:g}·|eager|)")  # fmt: skip
    for col in ("mode", "path", "steps", "batch sizes", "max |graph - eager|", "verdict"):
        # Fold, never cut: every batch size drawn is shown, however narrow the terminal.
        table.add_column(col, justify="left" if col in ("mode", "path", "batch sizes") else "right", overflow="fold")
    for _, r in sorted(reports.items()):
        sizes = ",".join(map(str, sorted(set(r.sizes)))) or "-"
        table.add_row(r.mode, r.path, str(r.steps), sizes, f"{r.worst:.3g}",
                      "ok" if r.ok else "[red]MISMATCH[/red]")  # fmt: skip
    console.print(table)
    return 0 if all(r.ok for r in reports.values()) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    from sgl_piecewise.errors import SglPiecewiseError

    args = _parser().parse_args(argv)
    console = Console()
    if args.verbose:
        logging.basicConfig(format="%(name)s: %(message)s")
        logging.getLogger("sgl_piecewise").setLevel(logging.INFO)
    commands = {"bench": bench, "verify": verify_command}
    try:
        return commands[args.command](args, console)
    except SglPiecewiseError as exc:  # bad input: the message says what was expected
        # As plain text, not markup: messages name tensors as "[a.b.c]". Soft
        # wrap: a console that is not a terminal would break the line at 80.
        console.print(Text.assemble(("error:", "red"), " ", str(exc)), soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
