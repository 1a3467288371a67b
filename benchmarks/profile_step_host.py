"""Where the host time of one piecewise step goes (a script, not a test).

The 0.5b shape of the suite, bf16, ``triton`` attention, context 1024: the
piecewise graphs of the default sizes are captured, then whole steps
(metadata, model, LM head) of decode at batch 1 and 32 and of a 16-token
extend are run with a ``perf_counter`` timer around each component. Each
line is a component's host time per step (summed over its calls), its calls
per step and its time per call, averaged over 40 steps; the components nest
(``CompiledModel`` holds the module call, which holds the pieces and the
attention between them). The timers add about 0.3 µs per call. For scale,
the first lines give the step's host time untimed, the same step called
through Dynamo (as ``CompileOptions(dynamo_guards=True)`` calls it), the
host time before the first piece graph is called (untimed too), and a
whole-model graph step's.

    python benchmarks/profile_step_host.py --out results/
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
import types
from functools import partial

import suite
import torch
from common import free_batch, graph_step_fn, host_ms, step_fn, timed, write_json  # noqa: E402 (benchmarks/ is the script's folder)

from sgl_piecewise.backends.triton_kernels import decode as decode_kernels
from sgl_piecewise.compile import CompiledModel, compiled_model, direct_call, piece_graphs
from sgl_piecewise.compile import backend as compile_backend
from sgl_piecewise.compile.token_guards import size_oblivious_tracing
from sgl_piecewise.runner import ModelRunner


def dynamo_call(compiled: CompiledModel, input_ids, positions):
    """The call ``CompileOptions(dynamo_guards=True)`` makes every step:
    through Dynamo, whose guards pass and which calls the same compiled
    module."""
    with size_oblivious_tracing():
        return compiled.compiled(input_ids, positions)


def before_first_piece_us(run, reps: int = 30) -> float:
    """Median host time from a step's start to its first piece graph's
    call, each step after the card has finished the last: the card has
    nothing of this step to run until then."""
    call = piece_graphs.PieceGraphs.__call__
    times, started = [], [None]

    def first(self, *args):
        if started[0] is not None:
            times.append(time.perf_counter_ns() - started[0])
            started[0] = None
        return call(self, *args)

    piece_graphs.PieceGraphs.__call__ = first
    try:
        for _ in range(reps):
            torch.cuda.synchronize()
            started[0] = time.perf_counter_ns()
            run()
    finally:
        piece_graphs.PieceGraphs.__call__ = call
    torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def profile(run, module, backend) -> list:
    totals, calls = collections.Counter(), collections.Counter()
    # In nesting order: the attention pieces, called by the split module as
    # instance attributes, hold the decode plan's launches.
    attention = [(vars(module.split_gm), p.name, "    attention between pieces") for p in module.pieces
                 if p.is_splitting_op]  # fmt: skip
    components = [
        (compiled_model.CompiledModel, "__call__", "CompiledModel call"),
        (direct_call.LastInputs, "fetch", "  weights, the last call's"),
        (direct_call.LastInputs, "current", "  weights compared, after the launches"),
        (compile_backend.PiecewiseModule, "__call__", "  module call"),
        (compile_backend.PiecewiseModule, "_pad", "    pad token inputs"),
        (compile_backend.PiecewiseModule, "_graph_set", "    weight addresses (a new set only)"),
        (compile_backend.PiecewiseModule, "_unpad", "    copy out real rows"),
        (piece_graphs.PieceGraphs, "__call__", "    piece replay"),
        (torch.cuda.CUDAGraph, "replay", "      CUDAGraph.replay"),
        *attention,
        (decode_kernels.DecodePlan, "launch", "      decode plan launch"),
        (type(backend), "init_forward_metadata", "attention metadata"),
        (ModelRunner, "last_token_logits", "LM head"),
    ]
    reps = 40
    with timed(components, totals, calls):
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        totals.clear()
        calls.clear()
        start = time.perf_counter_ns()
        for _ in range(reps):
            run()
            torch.cuda.synchronize()
        step = (time.perf_counter_ns() - start) / reps / 1e3
    rows = [("step, timed (host and device)", step, 1.0, step)]
    for label in dict.fromkeys(label for _, _, label in components):
        if calls[label]:
            rows.append((label, totals[label] / reps / 1e3, calls[label] / reps, totals[label] / calls[label] / 1e3))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for profile_step_host.json")
    cli = p.parse_args()
    args = types.SimpleNamespace(shape="0.5b", device="cuda", backend="triton", context=1024,
                                 decode_bs=[1, 32], extend=[16])  # fmt: skip
    model, runner = suite.build(args)
    piecewise, _ = suite.start_up(runner)
    whole, _ = suite.whole_model_runners(runner, max(args.decode_bs))
    (module,) = piecewise.compiled.piecewise_modules
    results = {}
    with torch.no_grad():
        for kind, size in [("decode", 1), ("decode", 32), ("extend", 16)]:
            batch = suite.step_batch(args, runner, kind, size)
            run = step_fn(runner, piecewise.compiled, batch)
            through_dynamo = step_fn(runner, partial(dynamo_call, piecewise.compiled), batch)
            host = {"piecewise": 1e3 * host_ms(run), "piecewise_through_dynamo": 1e3 * host_ms(through_dynamo),
                    "piecewise_before_first_piece": before_first_piece_us(run)}  # fmt: skip
            if kind == "decode":
                host["whole_model"] = 1e3 * host_ms(graph_step_fn(runner, whole["whole_model"], batch))
            print(f"\n{kind} {size}: step host time untimed, us: " + ", ".join(f"{k} {v:.0f}" for k, v in host.items()))
            print(f"\n  {'component':34s} {'us/step':>8s} {'calls':>6s} {'us/call':>8s}")
            rows = profile(run, module, runner.backend)
            for label, per_step, n, per_call in rows:
                print(f"  {label:34s} {per_step:8.1f} {n:6.1f} {per_call:8.2f}")
            results[f"{kind}_{size}"] = {"host_us": host, "components": rows}
            free_batch(runner, batch)
    if cli.out:
        write_json(cli.out, "profile_step_host.json", results)


if __name__ == "__main__":
    main()
