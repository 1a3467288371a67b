"""The attention between compiled pieces, per backend (a script, not a test).

For each ``--backends`` entry: the suite's shape with that attention backend,
piecewise graphs of exactly the decode batch sizes and whole-model graphs of
the same sizes (the model compiled whole), then per decode batch size a
piecewise and a whole-model step timed in interleaved rounds
(``common.time_paths``) and the host time of one attention call between the
pieces (``suite_profile.hop_host_us_per_layer``). Run it at two commits to
compare a backend's hop before and after a change.

    python benchmarks/bench_backend_hops.py --out results/                                   # GPU
    python benchmarks/bench_backend_hops.py --device cpu --shape tiny --backends torch --out r/  # the logic, on a CPU

Writes ``backend_hops.json`` and returns it.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from functools import partial

import torch
import torch._dynamo
from common import SHAPES, free_batch, graph_step_fn, step_fn, time_paths, write_json  # noqa: E402 (benchmarks/ is the folder)
from suite import build, step_batch
from suite_profile import hop_host_us_per_layer

from sgl_piecewise.compile import CompiledModel, CompileOptions
from sgl_piecewise.runners import CudaGraphRunner, PiecewiseCudaGraphRunner


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer", "torch"])
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=1024, help="tokens per decode request, the new one included")
    p.add_argument("--rounds", type=int, default=8, help="interleaved timing rounds per batch size")
    return p.parse_args(argv)


def backend_rows(args, backend: str) -> dict:
    """Piecewise and whole-model decode steps and the hop, per batch size."""
    torch._dynamo.reset()
    shape = argparse.Namespace(shape=args.shape, device=args.device, decode_bs=args.decode_bs,
                               context=args.context, extend=[1], backend=backend)  # fmt: skip
    model, runner = build(shape)
    sizes = tuple(sorted(set(args.decode_bs)))
    piecewise = PiecewiseCudaGraphRunner(runner, CompileOptions(cudagraphs=True, capture_sizes=sizes))
    piecewise.capture(progress=False)
    whole = CudaGraphRunner(runner, sizes, forward=CompiledModel(model, CompileOptions(split_graph=False)))
    whole.capture(progress=False)
    runner.step_graphs = None  # every path is timed explicitly
    rows = {}
    for bs in args.decode_bs:
        batch = step_batch(shape, runner, "decode", bs)
        paths = {"piecewise": partial(step_fn, runner, piecewise.compiled, batch),
                 "whole_model": partial(graph_step_fn, runner, whole, batch)}  # fmt: skip
        row = time_paths(paths, rounds=args.rounds)
        row["hop_us_per_layer"] = hop_host_us_per_layer(piecewise.compiled, runner, batch)
        rows[bs] = row
        print(backend, "decode", bs, json.dumps(row), flush=True)
        free_batch(runner, batch)
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch._dynamo.config.cache_size_limit = 64  # one compile per backend and variant
    result = {"shape": args.shape, "argv": sys.argv[1:] if argv is None else list(argv), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "card": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "backends": {}}  # fmt: skip
    for backend in args.backends:
        result["backends"][backend] = backend_rows(args, backend)
        gc.collect()  # the backend's model, pools and graphs, before the next one's
        if args.device == "cuda":
            torch.cuda.empty_cache()
    write_json(args.out, "backend_hops.json", result)
    return result


if __name__ == "__main__":
    main()
