"""``sgl-piecewise`` (also ``python -m sgl_piecewise``): the command-line main job.

``sgl-piecewise bench`` runs one ragged batch of prompts through the same model
four ways — eager; compiled by the ``sgl_piecewise`` backend; compiled with
piecewise CUDA graphs; and piecewise graphs for the prefill with whole-model
decode graphs (``CudaGraphRunner``) for every decode step — checks that they
produce the same tokens, and prints a table of set-up time, prefill time and
decode step time. On a CPU the graph capture is a pass-through (everything
else runs as on a GPU).

``sgl-piecewise verify`` replays the graphs against eager on fresh random
ragged batches (``sgl_piecewise.verify``) and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

MODES = ("eager", "compiled", "graphs", "decode-graphs")
# What each command runs that needs a backend with graph hooks.
GRAPH_MODES = ("decode-graphs",)
DESCRIPTION = (
    "The CUDA-graph and torch.compile layer of an LLM engine, from the command line: "
    "bench runs one ragged batch eagerly, compiled and through graphs and checks the tokens agree; "
    "verify replays graphs against eager on random ragged batches."
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModeResult:
    mode: str
    setup_s: float
    prefill_ms: float
    decode_ms: Optional[float]  # None: no decode step (one new token)
    tokens: List[List[int]]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sgl-piecewise", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="eager vs compiled vs piecewise graphs on one batch")
    _add_model_args(b)
    b.add_argument("--batch-size", type=int, default=4)
    b.add_argument("--prompt-len", type=int, default=48, help="longest prompt; prompts are ragged, down to half of it")
    b.add_argument("--new-tokens", type=int, default=16)
    b.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    b.add_argument("--piece-compiler", default="inductor", choices=["inductor", "eager", "tensorrt"])
    b.add_argument("--max-capture-size", type=int, default=64, help="largest token count captured as graphs")
    _add_draft_argument(b)
    v = sub.add_parser("verify", help="graph replay vs eager on random ragged batches")
    _add_model_args(v)
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
                        "(the oracle; no graph hooks: not for decode-graphs or verify)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "-v", "--verbose", action="store_true", help="log what the library decides (KV pool size, fallbacks)"
    )


def _add_draft_argument(p: argparse.ArgumentParser) -> None:
    from sgl_piecewise.speculative_bench import add_draft_argument

    add_draft_argument(p)


def _check_backend(name: str, needs_graphs: Sequence[str]) -> None:
    """Before anything is loaded: the backend exists and has graph hooks if ``needs_graphs`` names a mode."""
    from sgl_piecewise.backends.factory import backend_names, get_backend_class
    from sgl_piecewise.errors import InvalidInputError

    if name not in backend_names():
        raise InvalidInputError(f"--backend: expected one of {list(backend_names())}, got {name!r}")
    if needs_graphs and not get_backend_class(name).supports_cuda_graph:
        raise InvalidInputError(
            f"--backend {name}: expected a backend with graph hooks for {', '.join(needs_graphs)}, got one "
            f"without; use torch, triton or flashinfer, or leave those modes out"
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


def _prompts(batch_size: int, prompt_len: int, vocab: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    lengths = [rng.randint(max(1, prompt_len // 2), prompt_len) for _ in range(batch_size)]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _run_mode(mode: str, model, args, prompts) -> ModeResult:
    from sgl_piecewise.compile import CompiledModel
    from sgl_piecewise.compile.options import CompileOptions
    from sgl_piecewise.runner import ModelRunner
    from sgl_piecewise.runners.piecewise import PiecewiseCudaGraphRunner
    from sgl_piecewise.runners.whole_model import CudaGraphRunner

    context = max(len(p) for p in prompts) + args.new_tokens
    runner = ModelRunner(
        model,
        max_reqs=len(prompts),
        max_context_len=min(max(context, args.max_capture_size), model.config.max_position_embeddings),
        backend=_backend_factory(args.backend, model),
    )
    start = time.perf_counter()
    if mode == "compiled":
        runner.model_forward = CompiledModel(model, CompileOptions(piece_compiler=args.piece_compiler))
    elif mode in ("graphs", "decode-graphs"):
        options = CompileOptions(
            cudagraphs=True, max_capture_size=args.max_capture_size, piece_compiler=args.piece_compiler
        )
        PiecewiseCudaGraphRunner(runner, options).capture(progress=True)
        if mode == "decode-graphs":
            CudaGraphRunner(runner).capture(progress=True)
    # Compile, capture and warm up (kernel JIT, allocator) outside the timed run.
    runner.generate(prompts, 2)
    setup = time.perf_counter() - start
    runner.step_stats.clear()
    tokens = runner.generate(prompts, args.new_tokens, progress=args.new_tokens >= 64)
    steps = list(runner.step_stats)
    decode = [s.seconds for s in steps[1:]]
    decode_ms = 1e3 * sum(decode) / len(decode) if decode else None
    return ModeResult(mode, setup, steps[0].seconds * 1e3, decode_ms, tokens)


def _agreement(results: Sequence[ModeResult]) -> List[str]:
    ref = results[0]
    lines = []
    for r in results[1:]:
        same = sum(a == b for ra, rb in zip(ref.tokens, r.tokens) for a, b in zip(ra, rb))
        total = sum(len(t) for t in ref.tokens)
        lines.append(f"{r.mode} vs {ref.mode}: {same}/{total} generated tokens identical")
    return lines


def bench(args: argparse.Namespace, console: Console) -> int:
    from sgl_piecewise.checks import check_positive_int
    from sgl_piecewise.models.loader import load_model_or_default

    if args.draft is not None:
        from sgl_piecewise.speculative_bench import bench_draft

        return bench_draft(args, console)
    for name in ("batch_size", "prompt_len", "new_tokens", "max_capture_size"):
        check_positive_int(f"--{name.replace('_', '-')}", getattr(args, name))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"--modes: expected a subset of {MODES}, got {args.modes!r}")
    _check_backend(args.backend, [m for m in modes if m in GRAPH_MODES])
    device, dtype = _resolve_device_dtype(args.device, args.dtype)
    model = load_model_or_default(args.model, dtype, device, seed=args.seed)
    prompts = _prompts(args.batch_size, args.prompt_len, model.config.vocab_size, args.seed)
    console.print(
        f"model: {args.model or 'embedded default (random weights)'} | {model.config.architecture} | "
        f"{model.config.num_hidden_layers} layers | device {device} | {dtype} | backend {args.backend} | "
        f"batch {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens"
    )
    results = []
    for mode in modes:
        console.print(f"[bold]{mode}[/bold] ...")
        results.append(_run_mode(mode, model, args, prompts))
    table = Table(title="sgl-piecewise bench")
    for col in ("mode", "set-up s", "prefill ms", "decode ms/step", "speed-up vs first"):
        table.add_column(col, justify="right" if col != "mode" else "left")
    for r in results:
        # --new-tokens 1 has no decode step: nothing to time or compare.
        decode = "-" if r.decode_ms is None else f"{r.decode_ms:.3f}"
        speedup = "-" if r.decode_ms is None else f"{results[0].decode_ms / r.decode_ms:.2f}x"
        table.add_row(r.mode, f"{r.setup_s:.2f}", f"{r.prefill_ms:.2f}", decode, speedup)
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
    from sgl_piecewise.models.loader import load_model_or_default
    from sgl_piecewise.verify import TOLERANCE, verify

    _check_backend(args.backend, ["verify"])
    device, dtype = _resolve_device_dtype(args.device, args.dtype)
    model = load_model_or_default(args.model, dtype, device, seed=args.seed)
    reports = verify(
        model,
        _backend_factory(args.backend, model),
        steps=args.steps, max_bs=args.max_bs, seed=args.seed,
        max_context_len=min(256, model.config.max_position_embeddings),
    )  # fmt: skip
    atol, rtol = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    table = Table(title=f"sgl-piecewise verify ({device}, {dtype}, backend {args.backend}, "
                        f"tolerance {atol:g} + {rtol:g}·|eager|)")  # fmt: skip
    for col in ("mode", "steps", "batch sizes", "eager fallbacks", "max |graph - eager|", "verdict"):
        # Fold, never cut: every batch size drawn is shown, however narrow the terminal.
        table.add_column(col, justify="left" if col in ("mode", "batch sizes") else "right", overflow="fold")
    for r in reports.values():
        sizes = ",".join(map(str, sorted(set(r.sizes)))) or "-"
        table.add_row(r.mode, str(r.steps), sizes, str(r.fallbacks), f"{r.worst:.3g}",
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
