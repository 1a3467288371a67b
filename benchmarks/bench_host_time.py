"""Host time per step of the graph paths (a script, not a test): the wall
time until a step's launches are queued, for the whole-model decode graphs
and the piecewise graphs, decode and extend.

    python benchmarks/bench_host_time.py --shape 0.5b --out results/

Host time between two processes moves with the host's other load far more
than a change to the library does, so the figure to compare is the least
of many steps (that load only adds to a step's) and a comparison of two
library trees alternates their processes on one machine. The step paths
and the model are the suite's (``suite.py``); the timed steps run pinned to
one core (``--core``), in ``--rounds`` interleaved rounds. Writes
``host_<shape>.json``: per row and path the least, the 10th percentile and
the median host time in ms, and the median step time. ``--device cpu``
runs the logic (a step's host time is then its wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import free_batch, time_paths, write_json  # noqa: E402
from suite import build, start_up, step_batch, step_paths, whole_model_runners  # noqa: E402


def host_row(paths: dict, rounds: int, iters: int) -> dict:
    """Each path's host and step times over ``rounds`` interleaved rounds
    (``common.time_paths``); a path that fails raises."""
    samples = {}
    result = time_paths(paths, rounds, iters, samples=samples)
    errors = {k: v for k, v in result.items() if k.endswith("_error")}
    if errors:
        raise RuntimeError(f"expected every path to run, got {errors}")
    row = {}
    for name, timed in samples.items():
        # Without CUDA no launches are queued: the host's time is the step's.
        times = sorted(timed["host"] or timed["step"])
        row[name] = {
            "host_min_ms": times[0],
            "host_p10_ms": times[len(times) // 10],
            "host_median_ms": statistics.median(times),
            "step_ms": result[name],
            "samples": len(times),
        }
    return row


def time_rows(args, suite_args, runner, piecewise, whole) -> dict:
    rows = {}
    for kind, sizes in (("decode", args.decode_bs), ("extend", args.extend)):
        for size in sizes:
            batch = step_batch(suite_args, runner, kind, size)
            paths = step_paths(runner, batch, piecewise.compiled, whole if kind == "decode" else {}, False)
            del paths["eager"]
            paths.pop("whole_model_pieces", None)
            rows[f"{kind} {size}"] = row = host_row(paths, args.rounds, args.iters)
            print(kind, size, json.dumps(row), flush=True)
            free_batch(runner, batch)
    return rows


def run(args) -> dict:
    suite_args = argparse.Namespace(
        shape=args.shape,
        device=args.device,
        backend="triton" if args.device == "cuda" else "torch",
        context=args.context,
        decode_bs=args.decode_bs,
        extend=args.extend,
        fused_projections=False,
    )
    _, runner = build(suite_args)
    piecewise, _ = start_up(runner)
    whole, _ = whole_model_runners(runner, max(args.decode_bs))
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {args.core})
    try:
        rows = time_rows(args, suite_args, runner, piecewise, whole)
    finally:
        os.sched_setaffinity(0, cores)
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    return {"shape": args.shape, "card": card, "torch": torch.__version__, "core": args.core, "rows": rows}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 32])
    p.add_argument("--extend", type=int, nargs="+", default=[16, 512])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--core", type=int, default=2, help="the core the timed steps run on")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.iters < 1:
        p.error(f"--rounds and --iters: expected at least 1, got {args.rounds} and {args.iters}")
    if args.core not in os.sched_getaffinity(0):
        p.error(f"--core: expected one of this process's cores {sorted(os.sched_getaffinity(0))}, got {args.core}")
    result = run(args)
    print("wrote", write_json(args.out, f"host_{args.shape}.json", result))
    return result


if __name__ == "__main__":
    main()
