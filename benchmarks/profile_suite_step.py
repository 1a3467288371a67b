"""Where a suite step's time goes (a script, not a test): the kernels of one
whole-model decode replay, host enqueue time against wall time of a
piecewise step, a whole-model step and the attention metadata alone, the
kernels of a piecewise step, and cProfile of piecewise steps. The 0.5b shape
of ``suite.py``, bf16, triton backend, context 1024.

    python benchmarks/profile_suite_step.py [--decode-bs 1 32]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import types

import suite
import torch
from common import free_batch, graph_step_fn, host_ms, median_ms, step_fn  # noqa: E402 (benchmarks/ is the script's folder)
from torch.profiler import ProfilerActivity, profile


def kernel_rows(fn, reps: int = 10) -> list:
    """Per kernel of one call of ``fn``: name, launches and µs of device
    time per call, largest first."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per_kernel = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count_us = per_kernel.setdefault(e.name[:90], [0, 0.0])
            count_us[0] += 1
            count_us[1] += e.device_time_total
    rows = [{"kernel": name, "launches": n / reps, "us": us / reps} for name, (n, us) in per_kernel.items()]
    return sorted(rows, key=lambda row: -row["us"])


def kernel_table(fn, reps: int = 10, top: int = 25) -> list:
    """Print the kernels per call of ``fn`` and their summed device time; the rows."""
    rows = kernel_rows(fn, reps)
    print(f"  kernels/step {sum(r['launches'] for r in rows):.0f}, "
          f"summed device time/step {sum(r['us'] for r in rows):.1f} us")  # fmt: skip
    for r in rows[:top]:
        print(f"  {r['launches']:6.1f} x {r['us'] / r['launches']:7.2f} us = {r['us']:8.1f} us  {r['kernel']}")
    return rows


def host_and_wall_ms(run, reps: int = 30) -> tuple:
    """(median host time to enqueue one ``run``, median CUDA-event wall time)."""
    return host_ms(run, reps), median_ms(run)


def cprofile(run, reps: int = 30, top: int = 30) -> None:
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        run()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print("\n".join(line for line in out.getvalue().splitlines()[4:] if line.strip()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 32])
    cli = p.parse_args()
    args = types.SimpleNamespace(shape="0.5b", device="cuda", backend="triton", context=1024,
                                 decode_bs=cli.decode_bs, extend=[16])  # fmt: skip
    model, runner = suite.build(args)
    piecewise, _ = suite.start_up(runner)
    whole, _ = suite.whole_model_runners(runner, max(cli.decode_bs))
    graphs = whole["whole_model"]
    with torch.no_grad():
        for bs in args.decode_bs:
            batch = suite.step_batch(args, runner, "decode", bs)
            print(f"\n=== decode bs {bs}: whole-model replay kernels")
            # Through try_replay, which fills the graph's inputs with this batch
            # first: the bare graph would replay the last capture's dummy step,
            # whose requests have one key each (a 3.3 us decode kernel on an
            # H100 against 8.5 us for 1024 keys).
            kernel_table(lambda b=batch: graphs.try_replay(b))
            paths = {
                "piecewise step": step_fn(runner, piecewise.compiled, batch),
                "whole_model step": graph_step_fn(runner, graphs, batch),
                "attention metadata only": lambda b=batch: runner.backend.init_forward_metadata(b),
            }
            for name, run in paths.items():
                host, wall = host_and_wall_ms(run)
                print(f"  {name}: host enqueue {host:.3f} ms, wall {wall:.3f} ms")
            print(f"=== decode bs {bs}: piecewise step kernels")
            kernel_table(paths["piecewise step"], reps=5, top=20)
            print(f"=== decode bs {bs}: cProfile of 30 piecewise steps")
            cprofile(paths["piecewise step"])
            free_batch(runner, batch)


if __name__ == "__main__":
    main()
