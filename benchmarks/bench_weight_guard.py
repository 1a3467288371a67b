"""What the weight guard costs a whole-model and a breakable step (a script, not a test).

Whole-model and breakable graphs check, at every replay, that the model's
weights are where capture found them (``runners/weight_guard.py``): the
first and last weights before the replay, every weight right after the
graph (or its first segment) is launched. This builds a suite shape (bf16,
``triton`` attention, context 1024), whole-model graphs recording the model
compiled whole and breakable graphs, both of ``--decode-bs``, and times a
decode step (fill, replay, LM head) through each with the guard's checks
and with them replaced by nothing for that path's steps, in interleaved
rounds (``common.time_paths``). ``check_us`` / ``check_first_us``: host µs
of one check alone, median of 2000.

    python benchmarks/bench_weight_guard.py --out results/ [--shape 1b]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import types
from functools import partial
from unittest import mock

import suite
import torch
from common import card_info, each_step_within, free_batch, graph_step_fn, time_paths, write_json  # noqa: E402

from sgl_piecewise.compile import CompiledModel, CompileOptions
from sgl_piecewise.runners import BreakableCudaGraphRunner, CudaGraphRunner
from sgl_piecewise.runners.weight_guard import WeightGuard


def guard(on: bool) -> contextlib.ExitStack:
    """While inside, the guard's checks are its own (``on``) or do nothing;
    both ways patch the same two methods, so the paths' steps pay alike."""
    stack = contextlib.ExitStack()
    for name in ("check", "check_first"):
        check = getattr(WeightGuard, name) if on else (lambda self: None)
        stack.enter_context(mock.patch.object(WeightGuard, name, check))
    return stack


def breakable_step_fn(runner, breakable, batch):
    """A step through the breakable graphs, then the LM head."""

    def run():
        return runner.last_token_logits(breakable.replay(batch, breakable.padded_size(batch.num_tokens)), batch)

    return run


def host_us(fn, reps: int = 2000) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", choices=sorted(suite.SHAPES), default="0.5b")
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=12)
    cli = p.parse_args()
    args = types.SimpleNamespace(shape=cli.shape, device="cuda", backend="triton", context=1024,
                                 decode_bs=cli.decode_bs, extend=[16])  # fmt: skip
    model, runner = suite.build(args)
    sizes = sorted(cli.decode_bs)
    whole = CudaGraphRunner(runner, sizes, forward=CompiledModel(runner.model, CompileOptions(split_graph=False)))
    whole.capture(progress=False)
    breakable = BreakableCudaGraphRunner(runner, sizes)
    breakable.capture(progress=False)
    runner.step_graphs = runner.token_graphs = None  # every path is timed explicitly
    weights = whole._weights
    result = {"weights": len(weights._refs), "check_us": host_us(weights.check),
              "check_first_us": host_us(weights.check_first), "decode": {}}  # fmt: skip
    with torch.no_grad():
        for bs in cli.decode_bs:
            batch = suite.step_batch(args, runner, "decode", bs)
            whole_step = partial(graph_step_fn, runner, whole, batch)
            breakable_step = partial(breakable_step_fn, runner, breakable, batch)
            on, off = partial(guard, True), partial(guard, False)
            paths = {"whole_model": each_step_within(on, whole_step),
                     "whole_model, guard off": each_step_within(off, whole_step),
                     "breakable": each_step_within(on, breakable_step),
                     "breakable, guard off": each_step_within(off, breakable_step)}  # fmt: skip
            result["decode"][bs] = row = time_paths(paths, rounds=cli.rounds)
            print(f"decode bs {bs:3d}  " + "  ".join(f"{k}: {v:.4f} ms" for k, v in row.items()
                                                     if not k.endswith("_maxdiff")), flush=True)  # fmt: skip
            free_batch(runner, batch)
    print(f"weights {result['weights']}: check {result['check_us']:.1f} us, "
          f"check_first {result['check_first_us']:.2f} us")  # fmt: skip
    write_json(cli.out, f"weight_guard_{cli.shape}.json", card_info(shape=cli.shape, **result))


if __name__ == "__main__":
    main()
