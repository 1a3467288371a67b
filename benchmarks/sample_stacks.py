"""Where a script's main thread spends its time, by sampling (a script, not a test).

Runs a Python script as ``python script.py args`` would, while a thread
samples the main thread's Python stack every few milliseconds
(``sys._current_frames``), and writes per function the seconds it was on the
stack (inclusive) and on its top (self), and the sampled stacks in order.
cProfile times every call, so it slows Python-heavy work (Dynamo's trace,
the Triton front end) far more than the rest and its shares of a start-up
are wrong; a sample costs the same wherever the thread is. It needs only
the standard library, for hosts where a sampling profiler such as py-spy
cannot be installed. A sample is taken when the sampler gets the GIL: Python's switch
interval (5 ms) bounds how often, so the seconds are counts scaled by the
wall time over the samples::

    python benchmarks/sample_stacks.py --out results/sampled.json -- benchmarks/profile_startup.py --out results/
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import runpy
import sys
import threading
import time
from typing import List, Tuple

Stack = List[str]


def _frame_names(frame) -> Stack:
    """The stack from its top, each frame as ``file:function`` (site-packages
    paths from the package on)."""
    names = []
    while frame is not None:
        code = frame.f_code
        names.append(f"{code.co_filename.split('site-packages/')[-1]}:{code.co_name}")
        frame = frame.f_back
    return names


class Sampler:
    """Samples ``thread_id``'s stack every ``interval`` seconds while running."""

    def __init__(self, thread_id: int, interval: float):
        self.thread_id, self.interval = thread_id, interval
        self.stacks: List[Tuple[float, Stack]] = []  # (seconds since start, stack)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        start = time.perf_counter()
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.thread_id)
            if frame is not None:
                self.stacks.append((time.perf_counter() - start, _frame_names(frame)))

    def summary(self, top: int) -> dict:
        wall = self.stacks[-1][0] if self.stacks else 0.0
        per_sample = wall / max(len(self.stacks), 1)
        inclusive, own = collections.Counter(), collections.Counter()
        for _, stack in self.stacks:
            own[stack[0]] += 1
            inclusive.update(set(stack))  # a recursive function counts once per sample

        def seconds(counter):
            return [{"function": name, "seconds": round(n * per_sample, 3)} for name, n in counter.most_common(top)]

        return {"wall_seconds": round(wall, 3), "samples": len(self.stacks), "inclusive": seconds(inclusive),
                "self": seconds(own), "stacks": [(round(t, 3), s[:80]) for t, s in self.stacks]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--interval-ms", type=float, default=4.0)
    p.add_argument("--top", type=int, default=300, help="functions listed, by seconds")
    p.add_argument("script", help="the script to run, then its arguments (after --)")
    p.add_argument("args", nargs=argparse.REMAINDER)
    cli = p.parse_args()
    if not cli.interval_ms > 0 or cli.top < 1:
        p.error(f"expected --interval-ms > 0 and --top >= 1, got {cli.interval_ms} and {cli.top}")
    if not os.path.isfile(cli.script):
        p.error(f"expected a Python script to run, got {cli.script!r} (no such file)")
    sys.argv = [cli.script, *cli.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(cli.script)))  # as `python script.py` would
    sampler = Sampler(threading.main_thread().ident, cli.interval_ms / 1e3)
    try:
        with sampler:
            runpy.run_path(cli.script, run_name="__main__")
    finally:
        os.makedirs(os.path.dirname(os.path.abspath(cli.out)), exist_ok=True)
        with open(cli.out, "w") as f:
            json.dump(sampler.summary(cli.top), f)


if __name__ == "__main__":
    main()
