"""Is a step bound by the host or by the card? (a script, not a test)

For a piecewise step and a whole-model step of the suite's 0.5b shape (bf16,
triton, context 1024), one torch.profiler trace each, read as a timeline:
the step's wall time (first launch call to last kernel end), the card's busy
time (the union of its kernels), and every idle gap between two kernels,
charged to the host when the second kernel's launch call (kernel or graph)
came after the first kernel had ended (the card waited for the host), and
to the device otherwise (the card had the work queued: launch latency,
a graph's start). Median over the traced steps.

    python benchmarks/profile_step_timeline.py --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import types

import suite
import torch
from common import free_batch, graph_step_fn, step_fn  # noqa: E402 (benchmarks/ is the script's folder)
from torch.profiler import ProfilerActivity, profile

_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch", "cudaLaunchKernelExC")


def trace_events(run, steps: int) -> list:
    """The chrome-trace events of ``steps`` calls of ``run``, each synchronised."""
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run()
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return json.load(open(f.name))["traceEvents"]


def split_steps(events: list) -> list:
    """Per step: its kernels [(start, end, launch call end)] in start order.
    Steps are told apart by the synchronisation that ends each."""
    launch_end = {
        e["args"]["correlation"]: e["ts"] + e["dur"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("name", "").startswith(_LAUNCHES) and "args" in e
    }
    syncs = sorted(e["ts"] for e in events if e.get("name") in ("cudaDeviceSynchronize", "cudaStreamSynchronize"))
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"], launch_end.get(e["args"].get("correlation"), e["ts"]))
        for e in events
        if e.get("cat") == "kernel"
    )
    steps, start = [], float("-inf")
    for end in syncs:
        steps.append([k for k in kernels if start <= k[2] < end])
        start = end
    return [s for s in steps if s]


def timeline(kernels: list) -> dict:
    """Wall, busy and idle time of one step's kernels, in µs."""
    first_launch = min(k[2] for k in kernels)
    busy, host_gaps, device_gaps, until = 0.0, 0.0, 0.0, None
    for start, end, launched in kernels:
        if until is not None and start > until:
            gap = start - until
            if launched > until:  # the card had nothing queued: waiting for the host
                host_gaps += min(gap, launched - until)
                device_gaps += gap - min(gap, launched - until)
            else:
                device_gaps += gap
        busy += max(0.0, end - max(start, until or start))
        until = end if until is None else max(until, end)
    wall = until - first_launch
    first_kernel = kernels[0][0] - first_launch
    return {"wall_us": wall, "busy_us": busy, "host_gap_us": host_gaps, "device_gap_us": device_gaps,
            "before_first_kernel_us": first_kernel, "kernels": len(kernels)}  # fmt: skip


def summarize(run, steps: int = 12) -> dict:
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    rows = [timeline(k) for k in split_steps(trace_events(run, steps))]
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--extend", type=int, nargs="*", default=[16])
    cli = p.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    args = types.SimpleNamespace(shape="0.5b", device="cuda", backend="triton", context=1024,
                                 decode_bs=cli.decode_bs, extend=cli.extend or [16])  # fmt: skip
    model, runner = suite.build(args)
    piecewise, _ = suite.start_up(runner)
    whole, _ = suite.whole_model_runners(runner, max(cli.decode_bs))
    result = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "argv": sys.argv[1:],
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "steps": {}}  # fmt: skip
    cases = [("decode", bs) for bs in cli.decode_bs] + [("extend", n) for n in cli.extend]
    with torch.no_grad():
        for kind, size in cases:
            batch = suite.step_batch(args, runner, kind, size)
            paths = {"piecewise": step_fn(runner, piecewise.compiled, batch)}
            if kind == "decode":
                paths["whole_model"] = graph_step_fn(runner, whole["whole_model"], batch)
            for name, run in paths.items():
                row = summarize(run)
                result["steps"][f"{kind} {size} {name}"] = row
                print(f"{kind} {size:4d} {name:12s} " + "  ".join(f"{k} {v:7.1f}" for k, v in row.items()), flush=True)
            free_batch(runner, batch)
    json.dump(result, open(os.path.join(cli.out, "step_timeline.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
