"""Host-time profile of one decode step (a script, not a test): where the
Python time of eager and piecewise-graph steps goes.

    python benchmarks/profile_step.py --backend triton --bs 1
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch
from bench_steps import build  # noqa: E402
from common import cuda_median_ms, make_batch, step_fn  # noqa: E402

import sgl_piecewise as sp
from sgl_piecewise.compile import CompileOptions
from sgl_piecewise.runners.piecewise import PiecewiseCudaGraphRunner


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="triton")
    p.add_argument("--bs", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    args.decode_bs, args.extend = [args.bs], [16]
    model, runner = build(args)
    graphs = PiecewiseCudaGraphRunner(runner, CompileOptions(cudagraphs=True, capture_sizes=(1, 8, 32, 128)))
    graphs.capture(progress=False)
    batch = make_batch(runner, sp.ForwardMode.DECODE, [args.context - 1] * args.bs, [1] * args.bs)
    for name, fn in (("eager", model), ("piecewise_graphs", graphs.compiled)):
        run = step_fn(runner, fn, batch)
        with torch.no_grad():
            print(name, f"{cuda_median_ms(run):.3f} ms/step")
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                run()
            torch.cuda.synchronize()
            prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue()[:6000])


if __name__ == "__main__":
    main()
