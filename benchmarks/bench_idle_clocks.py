"""A whole-model decode step right after the card idled (a script, not a
test).

A GPU that idles for a few milliseconds lowers its clocks; the next steps
run slower until they are back up. A benchmark that times a fast path right
after a host-bound one (the eager model keeps the card idle most of its
13 ms step) measures part of that climb. For the suite's shape and each
``--decode-bs``, with the suite's batch (``--context`` tokens a request),
this times the whole-model decode step (metadata, graph replay, LM head):

* ``alone``: ``common.time_paths`` of the step by itself;
* ``with_eager``: ``common.time_paths`` of the eager step and this one,
  interleaved as the suite interleaves its paths;
* ``after_idle_<N>ms``: one step after the host slept N ms with the card
  idle (median, min and max of 20);
* ``steps_after_50ms_idle``: 12 steps in a row after 50 ms idle.

    python benchmarks/bench_idle_clocks.py --out results/
"""

from __future__ import annotations

import argparse
import time

import torch
from common import card_info, free_batch, graph_step_fn, make_batch, step_fn, step_times_ms, time_paths, write_json
from suite import build

import sgl_piecewise as sp
from sgl_piecewise.compile import CompiledModel, CompileOptions
from sgl_piecewise.runners import CudaGraphRunner
from sgl_piecewise.runners.whole_model import default_capture_sizes

IDLE_MS = (0, 2, 10, 50)


def after_idle(run, idle_ms: float, samples: int = 20) -> list:
    """Median, min and max ms of one step after ``idle_ms`` of an idle card."""
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        time.sleep(idle_ms / 1e3)
        times += step_times_ms(run, 1)
    times.sort()
    return [times[len(times) // 2], times[0], times[-1]]


def measure(runner, model, whole, bs: int, context: int) -> dict:
    batch = make_batch(runner, sp.ForwardMode.DECODE, [context - 1] * bs, [1] * bs)
    whole_step = lambda: graph_step_fn(runner, whole, batch)  # noqa: E731 (time_paths takes factories)
    row = {"bs": bs, "alone": time_paths({"whole_model": whole_step})["whole_model"]}
    row["with_eager"] = time_paths({"eager": lambda: step_fn(runner, model, batch), "whole_model": whole_step})
    run = whole_step()
    with torch.no_grad():
        for idle_ms in IDLE_MS:
            row[f"after_idle_{idle_ms}ms"] = after_idle(run, idle_ms)
        torch.cuda.synchronize()
        time.sleep(0.05)
        row["steps_after_50ms_idle"] = step_times_ms(run, 12)
    free_batch(runner, batch)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for bench_idle_clocks.json")
    p.add_argument("--shape", default="0.5b", choices=["0.5b", "1b"])
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 32])
    p.add_argument("--context", type=int, default=1024)
    args = p.parse_args()
    suite_args = argparse.Namespace(shape=args.shape, device="cuda", backend="triton", decode_bs=args.decode_bs,
                                    context=args.context, extend=[1])  # fmt: skip
    model, runner = build(suite_args)
    forward = CompiledModel(model, CompileOptions(split_graph=False))
    whole = CudaGraphRunner(runner, default_capture_sizes(max(args.decode_bs)), forward=forward)
    whole.capture(progress=False)
    runner.step_graphs = None  # the step is timed explicitly
    rows = []
    for bs in args.decode_bs:
        rows.append(measure(runner, model, whole, bs, args.context))
        print(rows[-1], flush=True)
    write_json(args.out, "bench_idle_clocks.json", card_info(shape=args.shape, rows=rows))


if __name__ == "__main__":
    main()
