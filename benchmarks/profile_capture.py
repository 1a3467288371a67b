"""Where the piecewise graphs' captures spend their host time (a script, not
a test).

The 0.5b shape of the suite, bf16, ``triton`` attention. Captures the
largest default size first (the compile, or its load from ``--cache-dir``),
then the other sizes in two alternating halves: one half timed plainly, the
other under ``torch.profiler`` (host activities only). Prints and writes the
seconds per size of each half and the profiled half's operators by their own
host time, per piece graph captured::

    python benchmarks/profile_capture.py --out results/ [--cache-dir DIR]

``--keep-cublas-workspaces``: a capture does not free cuBLAS's workspaces
before it begins (``common.cublas_workspaces_kept``), to time what freeing
them costs. ``--blas cublaslt``: torch's preferred BLAS
library for the captures.

Needs CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import types

import suite
import torch
from common import cublas_workspaces_kept, write_json  # noqa: E402 (benchmarks/ is the script's folder)
from torch.profiler import ProfilerActivity, profile

from sgl_piecewise.compile import CompileOptions, counters
from sgl_piecewise.runners import PiecewiseCudaGraphRunner

TOP_OPERATORS = 25


def captured(piecewise, sizes) -> tuple:
    """(seconds, piece graphs captured) of capturing ``sizes``."""
    graphs = counters.graphs_captured
    start = time.perf_counter()
    piecewise.capture(progress=False, sizes=sizes)
    return time.perf_counter() - start, counters.graphs_captured - graphs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--keep-cublas-workspaces", action="store_true")
    p.add_argument("--blas", choices=("cublas", "cublaslt"), default="cublas")
    cli = p.parse_args()
    torch.backends.cuda.preferred_blas_library(cli.blas)
    with cublas_workspaces_kept() if cli.keep_cublas_workspaces else contextlib.nullcontext():
        profile_captures(cli)


def profile_captures(cli) -> None:
    args = types.SimpleNamespace(shape="0.5b", device="cuda", backend="triton", context=1024,
                                 decode_bs=[1, 8, 32], extend=[16])  # fmt: skip
    model, runner = suite.build(args)
    piecewise = PiecewiseCudaGraphRunner(runner, CompileOptions(cudagraphs=True, cache_dir=cli.cache_dir))
    sizes = sorted(piecewise.options.capture_sizes, reverse=True)
    first_seconds, _ = captured(piecewise, sizes[:1])
    plain_sizes, profiled_sizes = sizes[1::2], sizes[2::2]
    plain_seconds, plain_graphs = captured(piecewise, plain_sizes)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled_seconds, profiled_graphs = captured(piecewise, profiled_sizes)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:TOP_OPERATORS]
    operators = [
        {"name": e.key, "calls_per_graph": e.count / profiled_graphs,
         "self_us_per_graph": e.self_cpu_time_total / profiled_graphs,
         "total_us_per_graph": e.cpu_time_total / profiled_graphs}
        for e in events
    ]  # fmt: skip
    result = {
        "shape": args.shape, "card": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "from_saved_compile": counters.compiles_loaded > 0,
        "keep_cublas_workspaces": cli.keep_cublas_workspaces, "blas": cli.blas,
        "first_size_seconds": first_seconds,
        "plain": {"sizes": len(plain_sizes), "seconds": plain_seconds, "graphs": plain_graphs,
                  "ms_per_graph": 1e3 * plain_seconds / plain_graphs},
        "profiled": {"sizes": len(profiled_sizes), "seconds": profiled_seconds, "graphs": profiled_graphs,
                     "ms_per_graph": 1e3 * profiled_seconds / profiled_graphs},
        "operators": operators,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "operators"}, indent=1))
    for op in operators:
        print(f"  {op['name'][:60]:60s} {op['calls_per_graph']:6.2f} calls  {op['self_us_per_graph']:8.1f} µs self"
              f"  {op['total_us_per_graph']:8.1f} µs total  per graph")  # fmt: skip
    name = "profile_capture_0.5b" + ("_workspaces_kept" if cli.keep_cublas_workspaces else "")
    name += "_cublaslt" if cli.blas == "cublaslt" else ""
    print("wrote", write_json(cli.out, f"{name}.json", result))


if __name__ == "__main__":
    main()
