"""Whole-model decode graphs compiled with an Inductor option off and on, side
by side (a script, not a test; CUDA only).

The suite's shape and ``triton`` backend; two ``CudaGraphRunner``s over one
model runner record the model compiled whole (``CompiledModel(...,
split_graph=False)``), one with the boolean Inductor option ``--option`` as
Inductor's default leaves it and one with it set to ``True``. Per decode
batch size: whole steps (eager first, for the logits' reference) and the
bare graph replays, each timed in interleaved rounds, and the largest logit
difference between the two graphs over ``--batches`` fresh batches (0 where
the option changes launches but not arithmetic).

    python benchmarks/bench_inductor_option.py --option triton.enable_pdl --out results/

Writes ``inductor_option_<shape>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial

import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from common import SHAPES, free_batch, graph_step_fn, median_ms, step_fn, time_paths, write_json  # noqa: E402 (the folder)
from suite import build, step_batch

from sgl_piecewise.compile import CompiledModel, CompileOptions
from sgl_piecewise.runners import CudaGraphRunner


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--option", required=True, help="a boolean Inductor config, e.g. triton.enable_pdl")
    p.add_argument("--out", required=True)
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=1024, help="tokens per decode request, the new one included")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--batches", type=int, default=20, help="fresh batches the two graphs' logits are compared on")
    return p.parse_args(argv)


def captured(runner, sizes, option: str, value: bool) -> CudaGraphRunner:
    """Whole-model graphs of ``sizes``, compiled (and so captured) with the option set to ``value``."""
    with inductor_config.patch({option: value}):
        graphs = CudaGraphRunner(runner, sizes, forward=CompiledModel(runner.model, CompileOptions(split_graph=False)))
        graphs.capture(progress=False)
    return graphs


def replay_ms(graphs: dict, batch, rounds: int) -> dict:
    """Median of each runner's bare graph replay for ``batch``, interleaved."""
    for g in graphs.values():
        g.try_replay(batch)  # fills the inputs the bare replays then read
    samples = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            samples[name].append(median_ms(g.captured_graph(batch.forward_mode, g.padded_bs(batch)).replay, 3, 10))
    return {f"{name}_graph_only": statistics.median(v) for name, v in samples.items()}


def logits_maxdiff(runner, shape, graphs: dict, bs: int, batches: int) -> float:
    plain, changed = graphs.values()
    worst = 0.0
    for _ in range(batches):
        batch = step_batch(shape, runner, "decode", bs)
        a = runner.last_token_logits(plain.try_replay(batch), batch)
        b = runner.last_token_logits(changed.try_replay(batch), batch)
        worst = max(worst, float((a - b).abs().max()))
        free_batch(runner, batch)
    return worst


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_inductor_option.py: expected a CUDA device, got none (it times CUDA graphs)")
    torch._dynamo.config.cache_size_limit = 64
    shape = argparse.Namespace(shape=args.shape, device="cuda", decode_bs=args.decode_bs, context=args.context,
                               extend=[1], backend="triton")  # fmt: skip
    model, runner = build(shape)
    sizes = tuple(sorted(set(args.decode_bs)))
    default = getattr(inductor_config, args.option.split(".")[0])
    for part in args.option.split(".")[1:]:
        default = getattr(default, part)
    graphs = {
        "default": captured(runner, sizes, args.option, default),
        "on": captured(runner, sizes, args.option, True),
    }
    runner.step_graphs = None  # every path is timed explicitly
    result = {"option": args.option, "default": default, "shape": args.shape, "torch": torch.__version__,
              "card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "argv": sys.argv[1:] if argv is None else list(argv), "decode": {}}  # fmt: skip
    with torch.no_grad():
        for bs in args.decode_bs:
            batch = step_batch(shape, runner, "decode", bs)
            paths = {"eager": partial(step_fn, runner, model, batch)}
            paths.update({name: partial(graph_step_fn, runner, g, batch) for name, g in graphs.items()})
            row = time_paths(paths, rounds=args.rounds)
            row.update(replay_ms(graphs, batch, args.rounds))
            free_batch(runner, batch)  # room for the fresh batches
            row["default_vs_on_logits_maxdiff"] = logits_maxdiff(runner, shape, graphs, bs, args.batches)
            result["decode"][bs] = row
            print("decode", bs, json.dumps(row), flush=True)
    write_json(args.out, f"inductor_option_{args.shape}.json", result)
    return result


if __name__ == "__main__":
    main()
