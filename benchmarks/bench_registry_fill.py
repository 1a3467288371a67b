"""Host time of the buffer registry's fill (a script, not a test).

A whole-model graph's replay starts with ``fill_from``: nothing the card can
do starts before it is done. This times, on the decode registry of the
whole-model graphs (``build_decode_registry``, with the host copy of the
lengths it keeps for a backend whose replay hook reads them), the fill of one decode
step's sources as it runs (planned: each source checked to copy as it is,
then the plan of the sizes) and the checked path that any other fill takes
(each source resolved, checked and planned anew), in alternating rounds,
median µs per fill. Each batch size is padded to the whole-model graphs'
next capture size (3 to 4, 30 to 32), as a replay pads it, so the padded
tails are written too. Runs on a CPU (``--device cpu``, the default) or CUDA.

    python benchmarks/bench_registry_fill.py --out results/
"""

from __future__ import annotations

import argparse
import bisect
import platform
import statistics
import sys
import time

import torch
from common import write_json  # noqa: E402 (benchmarks/ is the script's folder)

from sgl_piecewise.runners.buffer_registry import FillContext
from sgl_piecewise.runners.input_registries import build_decode_registry
from sgl_piecewise.runners.whole_model import default_capture_sizes


def sources(bs: int, device: str) -> dict:
    ids = lambda dtype: torch.randint(1, 1000, (bs,), dtype=dtype, device=device)  # noqa: E731
    return {
        "input_ids": ids(torch.int64), "positions": ids(torch.int64), "out_cache_loc": ids(torch.int64),
        "seq_lens": ids(torch.int32), "seq_lens_cpu": ids(torch.int32).cpu(), "req_pool_indices": ids(torch.int64),
        "extend_seq_lens": torch.ones(bs, dtype=torch.int32, device=device),
    }  # fmt: skip


def fill_paths(registry, batch, ctx) -> dict:
    """The fill as ``fill_from`` runs it, and through the checked path."""

    def checked():
        registry._fill_checked(batch, ctx)
        for slot in registry:  # the hooks, as fill_from runs them after either path
            if slot.post_fill is not None:
                slot.post_fill(slot, batch, ctx)

    return {"planned (fill_from)": lambda: registry.fill_from(batch, ctx), "checked path": checked}


def per_fill_us(fill, calls: int = 2000) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fill()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--bs", type=int, nargs="+", default=[1, 3, 8, 30, 32])
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    result = {"device": args.device, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "argv": sys.argv[1:], "us_per_fill": {}}  # fmt: skip
    sizes = default_capture_sizes(max(args.bs))
    for bs in args.bs:
        padded = sizes[bisect.bisect_left(sizes, bs)]
        registry = build_decode_registry(sizes[-1], args.device, seq_len_fill_value=1)
        paths = fill_paths(registry, sources(bs, args.device), FillContext.uniform(bs, padded))
        samples = {name: [] for name in paths}
        for fill in paths.values():
            per_fill_us(fill, 200)  # warm
        for _ in range(args.rounds):
            for name, fill in paths.items():
                samples[name].append(per_fill_us(fill))
        result["us_per_fill"][bs] = {"padded_bs": padded, **{name: statistics.median(v) for name, v in samples.items()}}
        times = "  ".join(f"{k} {v:6.1f} us" for k, v in result["us_per_fill"][bs].items() if k != "padded_bs")
        print(f"bs {bs:3d} (padded to {padded:3d})  {times}", flush=True)
    write_json(args.out, "registry_fill.json", result)


if __name__ == "__main__":
    main()
