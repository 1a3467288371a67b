"""What packing the attention's kept launches once saves a piecewise step (a
script, not a test).

Between compiled pieces, a layer's attention launches the launch its layer
kept at the last step (``StepLaunch.launch_again``). Through torch's static
launcher that launch is now kept packed as the launcher takes it; before,
every launch went through ``BoundKernel`` and ``StaticKernel``, which pack
the same arguments anew. This builds a suite shape (bf16, ``triton``
attention, context 1024) with piecewise graphs of the sizes timed, and
times a whole piecewise step (metadata, pieces, attention, LM head) at
``--decode-bs`` and ``--extend`` both ways, in interleaved rounds
(``common.time_paths``); "packed anew" puts the earlier launch back in
``StepLaunch.launch_kept`` for its steps only.

    python benchmarks/bench_packed_launch.py --out results/ [--shape 1b]
"""

from __future__ import annotations

import argparse
import types
from functools import partial
from unittest import mock

import suite
import torch
from common import card_info, each_step_within, free_batch, step_fn, time_paths, write_json  # noqa: E402

from sgl_piecewise.backends.triton_kernels.launch import StepLaunch
from sgl_piecewise.compile import CompileOptions
from sgl_piecewise.runners import PiecewiseCudaGraphRunner

_PACKED = StepLaunch.launch_kept


def _packed_anew(self, kept) -> None:
    """The launch before: the argument tuple through the bound kernel."""
    self._kernel(self.grid, *kept[0])


def step_with(launch, runner, compiled, batch):
    """A factory of one piecewise step whose kept launches go through ``launch``."""
    patch = partial(mock.patch.object, StepLaunch, "launch_kept", launch)
    return each_step_within(patch, lambda: step_fn(runner, compiled, batch))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", choices=sorted(suite.SHAPES), default="0.5b")
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--extend", type=int, nargs="*", default=[16])
    p.add_argument("--rounds", type=int, default=12)
    cli = p.parse_args()
    args = types.SimpleNamespace(shape=cli.shape, device="cuda", backend="triton", context=1024,
                                 decode_bs=cli.decode_bs, extend=cli.extend)  # fmt: skip
    model, runner = suite.build(args)
    piecewise = PiecewiseCudaGraphRunner(runner, CompileOptions(cudagraphs=True))
    piecewise.capture(progress=False, sizes=sorted(set(cli.decode_bs) | set(cli.extend)))
    rows = {}
    with torch.no_grad():
        for kind, sizes in (("decode", cli.decode_bs), ("extend", cli.extend)):
            for size in sizes:
                batch = suite.step_batch(args, runner, kind, size)
                paths = {"packed once": step_with(_PACKED, runner, piecewise.compiled, batch),
                         "packed anew": step_with(_packed_anew, runner, piecewise.compiled, batch)}  # fmt: skip
                rows[f"{kind} {size}"] = row = time_paths(paths, rounds=cli.rounds)
                print(f"{kind} {size:3d}  " + "  ".join(f"{k}: {v:.4f} ms" for k, v in row.items()
                                                        if not k.endswith("_maxdiff")), flush=True)  # fmt: skip
                free_batch(runner, batch)
    write_json(cli.out, f"packed_launch_{cli.shape}.json", card_info(shape=cli.shape, steps=rows))


if __name__ == "__main__":
    main()
