"""Dynamo's trace of a suite shape, with and without repeated regions (a
script, not a test).

``CompiledModel`` traces a decoder layer's code between its attention calls
once and stamps it out for the other layers where torch can
(``sgl_piecewise/regions.py``). This times the trace alone: from the first
call of a ``CompiledModel`` (eager pieces, piecewise graphs) to the moment the
backend receives Dynamo's graph, in one process, ``--rounds`` times each
way in alternation (``torch._dynamo.reset()`` before each), on the CPU
(fp32) or the GPU (bf16). It also checks that both traces hand the backend
the same ops in the same order. Where this torch cannot reuse a region,
only the plain trace is timed.

    python benchmarks/bench_trace.py --out results/ [--shape 1b] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import suite
import torch
import torch._dynamo
from common import free_batch, write_json  # noqa: E402 (benchmarks/ is the script's folder)

import sgl_piecewise as sp
from sgl_piecewise import regions
from sgl_piecewise.compile import CompiledModel, CompileOptions
from sgl_piecewise.compile import backend as compile_backend


def trace_once(model, runner, batch) -> tuple:
    """(seconds to the backend's call, the graph's call_function targets)."""
    torch._dynamo.reset()
    seen = {}
    compile_call = compile_backend.SglPiecewiseBackend.__call__

    def at_backend(self, gm, example_inputs):
        seen["t"] = time.perf_counter()
        seen["ops"] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        return compile_call(self, gm, example_inputs)

    compile_backend.SglPiecewiseBackend.__call__ = at_backend
    try:
        # Piecewise graphs, as the runners compile: the case regions apply to.
        compiled = CompiledModel(model, CompileOptions(piece_compiler="eager", cudagraphs=True))
        with torch.no_grad(), sp.forward_context(batch, runner.backend, check=False):
            start = time.perf_counter()
            compiled(batch.input_ids, batch.positions)
    finally:
        compile_backend.SglPiecewiseBackend.__call__ = compile_call
    return seen["t"] - start, seen["ops"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", choices=sorted(suite.SHAPES), default="0.5b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=3)
    cli = p.parse_args()
    backend = "torch" if cli.device == "cpu" else "triton"
    args = types.SimpleNamespace(shape=cli.shape, device=cli.device, backend=backend, context=64,
                                 decode_bs=[4], extend=[16])  # fmt: skip
    model, runner = suite.build(args)
    batch = suite.step_batch(args, runner, "decode", 4)
    runner.backend.init_forward_metadata(batch)
    original = regions.regions_available
    available = original()
    ways = {"plain": lambda: False, "regions": lambda: True} if available else {"plain": lambda: False}
    seconds = {name: [] for name in ways}
    ops = {}
    for _ in range(cli.rounds):
        for name, switch in ways.items():
            regions.regions_available = switch
            try:
                s, ops[name] = trace_once(model, runner, batch)
            finally:
                regions.regions_available = original
            seconds[name].append(s)
            print(f"{name:8s} trace {s:.3f} s, {len(ops[name])} ops", flush=True)
    free_batch(runner, batch)
    result = {"shape": cli.shape, "device": cli.device, "torch": torch.__version__, "regions_available": available,
              "trace_s": seconds, "median_s": {k: statistics.median(v) for k, v in seconds.items()},
              "same_ops": len({tuple(v) for v in ops.values()}) == 1}  # fmt: skip
    print(result["median_s"], "same ops:", result["same_ops"])
    print("wrote", write_json(cli.out, f"trace_{cli.shape}_{cli.device}.json", result))


if __name__ == "__main__":
    main()
