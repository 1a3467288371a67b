"""A whole-model decode step right after the card idled (a script, not a
test).

A step right after the card idled for a few milliseconds runs slower, and
the next steps recover (the card's clocks, or the host's: ``--clocks``
tells whether the SM clock moved). A benchmark that times a fast path right
after a host-bound one (the eager model keeps the card idle most of its
13 ms step) measures part of that recovery. For the suite's shape and each
``--decode-bs``, with the suite's batch (``--context`` tokens a request),
this times the whole-model decode step (metadata, graph replay, LM head):

* ``alone_sync_warmup``: ``common.time_paths`` of the step by itself, each
  round's steps after ``common.keep_busy``'s warm-up of synchronised steps
  (the suite's way);
* ``alone_queued_warmup``: the same after a warm-up of steps queued back to
  back without synchronising (the suite's way before);
* ``with_eager``: ``common.time_paths`` of the eager step and this one,
  interleaved as the suite interleaves its paths;
* ``after_idle_<N>ms``: one step after the host slept N ms with the card
  idle (median, min and max of 20);
* ``steps_after_50ms_idle``: 12 steps in a row after 50 ms idle;
* medians of windows of a long run: ``run_after_idle`` (400 synchronised
  steps after 50 ms idle) and ``run_after_queued_warmup`` (60 after a
  queued warm-up).

``--clocks``: ``nvidia-smi`` samples the SM clock, power and the reasons
the clock is held down every 20 ms, and each phase gets its samples' median.

    python benchmarks/bench_idle_clocks.py --out results/ [--shape 1b] [--clocks]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import statistics
import subprocess
import tempfile
import time

import torch
from common import (
    card_info,
    free_batch,
    graph_step_fn,
    keep_busy,
    make_batch,
    step_fn,
    step_times_ms,
    time_paths,
    write_json,
)
from suite import build

import sgl_piecewise as sp
from sgl_piecewise.compile import CompiledModel, CompileOptions
from sgl_piecewise.runners import CudaGraphRunner
from sgl_piecewise.runners.whole_model import default_capture_sizes

IDLE_MS = (0, 2, 10, 50)
# Windows (first and last step index) of a long run of steps.
RUN_WINDOWS = ((0, 10), (10, 50), (50, 100), (100, 200), (200, 400))
CLOCK_FIELDS = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"


class ClockLog:
    """``nvidia-smi`` sampling the card every 20 ms in a child process, and
    the wall-clock span of each named phase, to match samples to phases."""

    def __init__(self, enabled: bool):
        self.phases, self._proc = [], None
        if enabled:
            self._file = tempfile.NamedTemporaryFile("w+", suffix=".csv")
            query = f"--query-gpu=timestamp,{CLOCK_FIELDS}"
            cmd = ["nvidia-smi", query, "--format=csv,noheader,nounits", "-lms", "20"]
            self._proc = subprocess.Popen(cmd, stdout=self._file, stderr=subprocess.DEVNULL)

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.time()
        yield
        self.phases.append((name, start, time.time()))

    def close(self) -> dict:
        """Per phase: sample count and median of each field."""
        if self._proc is None:
            return {}
        self._proc.terminate()
        self._proc.wait()
        self._file.seek(0)
        rows = []
        for line in self._file.read().splitlines():
            stamp, *values = [v.strip() for v in line.split(",")]
            try:
                when = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
            except ValueError:
                continue
            rows.append((when, [_number_or_text(v) for v in values]))
        return {
            name: _phase_summary([v for when, v in rows if start <= when <= end]) for name, start, end in self.phases
        }


def _number_or_text(value: str):
    try:
        return float(value)
    except ValueError:
        return value


def _phase_summary(samples: list) -> dict:
    out = {"samples": len(samples)}
    for i, field in enumerate(CLOCK_FIELDS.split(",")):
        values = [s[i] for s in samples]
        numbers = [v for v in values if isinstance(v, float)]
        out[field] = statistics.median(numbers) if numbers else sorted(set(map(str, values)))
    return out


def windows(times: list) -> dict:
    """Median ms of each window of ``RUN_WINDOWS`` that ``times`` covers."""
    return {f"{a}-{b}": statistics.median(times[a:b]) for a, b in RUN_WINDOWS if len(times) >= b}


def after_idle(run, idle_ms: float, samples: int = 20) -> list:
    """Median, min and max ms of one step after ``idle_ms`` of an idle card."""
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        time.sleep(idle_ms / 1e3)
        times += step_times_ms(run, 1)
    times.sort()
    return [times[len(times) // 2], times[0], times[-1]]


def measure(runner, model, whole, bs: int, context: int, clocks: ClockLog) -> dict:
    batch = make_batch(runner, sp.ForwardMode.DECODE, [context - 1] * bs, [1] * bs)
    whole_step = lambda: graph_step_fn(runner, whole, batch)  # noqa: E731 (time_paths takes factories)
    row = {"bs": bs}
    with clocks.phase(f"bs{bs} alone_queued_warmup"):
        queued = functools.partial(keep_busy, sync_each=False)
        row["alone_queued_warmup"] = time_paths({"whole_model": whole_step}, warm_up=queued)["whole_model"]
    with clocks.phase(f"bs{bs} alone_sync_warmup"):
        row["alone_sync_warmup"] = time_paths({"whole_model": whole_step})["whole_model"]
    with clocks.phase(f"bs{bs} with_eager"):
        row["with_eager"] = time_paths({"eager": lambda: step_fn(runner, model, batch), "whole_model": whole_step})
    run = whole_step()
    with torch.no_grad():
        for idle_ms in IDLE_MS:
            row[f"after_idle_{idle_ms}ms"] = after_idle(run, idle_ms)
        torch.cuda.synchronize()
        time.sleep(0.05)
        row["steps_after_50ms_idle"] = step_times_ms(run, 12)
        time.sleep(0.05)
        with clocks.phase(f"bs{bs} run_after_idle"):
            row["run_after_idle"] = windows(step_times_ms(run, RUN_WINDOWS[-1][1]))
        with clocks.phase(f"bs{bs} queued warm-up"):
            keep_busy(run, sync_each=False)
        with clocks.phase(f"bs{bs} run_after_queued_warmup"):
            row["run_after_queued_warmup"] = windows(step_times_ms(run, 60))
    free_batch(runner, batch)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for bench_idle_clocks_<shape>.json")
    p.add_argument("--shape", default="0.5b", choices=["0.5b", "1b"])
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 32])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--clocks", action="store_true", help="sample the card's clocks with nvidia-smi")
    args = p.parse_args()
    suite_args = argparse.Namespace(shape=args.shape, device="cuda", backend="triton", decode_bs=args.decode_bs,
                                    context=args.context, extend=[1])  # fmt: skip
    model, runner = build(suite_args)
    forward = CompiledModel(model, CompileOptions(split_graph=False))
    whole = CudaGraphRunner(runner, default_capture_sizes(max(args.decode_bs)), forward=forward)
    whole.capture(progress=False)
    runner.step_graphs = None  # the step is timed explicitly
    rows, clocks = [], ClockLog(args.clocks)
    with clocks.phase("idle 1 s"):
        time.sleep(1.0)
    for bs in args.decode_bs:
        rows.append(measure(runner, model, whole, bs, args.context, clocks))
        print(rows[-1], flush=True)
    result = card_info(shape=args.shape, rows=rows, clocks=clocks.close())
    print(result["clocks"], flush=True)
    write_json(args.out, f"bench_idle_clocks_{args.shape}.json", result)


if __name__ == "__main__":
    main()
