"""What a GEMM costs the host while a CUDA graph is being captured (a script,
not a test).

A piece's capture calls cuBLAS about four times (Inductor's
``extern_kernels.mm``/``addmm`` with ``out=``). This times the host side of
one such call, for the 0.5b layer GEMMs at several token counts, in ways
side by side in one process:

* ``stream``: on a stream, no capture (the shape warmed up first);
* ``captured``: inside a capture begun as the runners begin theirs
  (``GraphCapture.begin_graph``, which first frees cuBLAS's workspaces so the
  capture allocates them inside its pool), one graph per call;
* ``captured_workspace_kept``: the same without freeing the workspaces;
* ``captured_cublaslt``: as ``captured``, with torch's preferred BLAS
  library set to cuBLASLt.

Median µs over ``--reps`` graphs, each holding two calls (the first one
allocates what the capture needs; the second shows the steady cost); the
graph's instantiation (``end_graph``) is timed too::

    python benchmarks/bench_capture_gemm.py --out results/

Needs CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from bench_skinny_gemm import SHAPES  # noqa: E402 (benchmarks/ is the script's folder)
from common import blas_library, cublas_workspaces_kept, host_ms, write_json

from sgl_piecewise.runners import capture as capture_core

ROWS = (1, 64, 512)


def gemm(x, w, b, out) -> None:
    """As Inductor's pieces call cuBLAS: ``mm``/``addmm`` into a given output."""
    if b is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(b, x, w.t(), out=out)


def captured_us(core, call, reps: int) -> tuple:
    """µs of ``call`` as the first and as the second call inside a capture,
    and of ending the capture; one graph per pair of calls."""
    first, second, ends, graphs = [], [], [], []
    with core.on_capture_stream():
        for _ in range(reps):
            graph = core.begin_graph()
            for times in (first, second):
                start = time.perf_counter()
                call()
                times.append(1e6 * (time.perf_counter() - start))
            start = time.perf_counter()
            core.end_graph(graph)
            ends.append(1e6 * (time.perf_counter() - start))
            graphs.append(graph)
    torch.cuda.synchronize()
    return first, second, ends


def measure(core, name: str, m: int, reps: int) -> dict:
    k, n, has_bias = SHAPES[name]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    call = lambda: gemm(x, w, b, out)  # noqa: E731
    row = {"stream_us": 1e3 * host_ms(call, reps, warmup=1)}
    ways = {
        "captured": contextlib.nullcontext,
        "captured_workspace_kept": cublas_workspaces_kept,
        "captured_cublaslt": lambda: blas_library("cublaslt"),
    }
    for way, setting in ways.items():
        with setting():
            call()  # a warm-up in this setting, outside a capture
            torch.cuda.synchronize()
            first, second, ends = captured_us(core, call, reps)
        row[f"{way}_us"] = statistics.median(first)
        row[f"{way}_second_call_us"] = statistics.median(second)
        row[f"{way}_end_graph_us"] = statistics.median(ends)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    core = capture_core.GraphCapture("cuda")
    result = {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "rows": {}}  # fmt: skip
    for name in [s for s in SHAPES if s.startswith("0.5b")]:
        for m in ROWS:
            row = measure(core, name, m, args.reps)
            result["rows"][f"{name} m={m}"] = row
            print(f"{name:14s} m={m:4d}", {k: round(v, 1) for k, v in row.items()}, flush=True)
    print("wrote", write_json(args.out, "capture_gemm.json", result))


if __name__ == "__main__":
    main()
