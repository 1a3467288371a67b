"""All-reduce inside a CUDA graph on two GPUs, per message size: torch's
one-shot symmetric-memory kernel against NCCL (a script, not a test).

    python benchmarks/bench_all_reduce.py --out results/

What sets the library's ``SMALL_ALL_REDUCE_MAX_BYTES``. Two ranks
(``distributed.launch``), each with one symmetric-memory buffer for the
largest message (``internals/symm_mem.py``, never multicast). Per message
size and path, one CUDA graph holds 48 all-reduces in a row, as a 24-layer
decode step does, each followed by a halving so every one reads the last
one's result; the graph is replayed 20 times between host barriers and the
median replay over 48 is the time per all-reduce (the halving included). Each
row checks the sum: ranks holding 1 and 2 give 1.5 after every step.

Paths: ``one_shot``, the library's (the op copies its input into the buffer
in its own kernel, ``one_shot_all_reduce_copy``); ``one_shot_copy_op``, its
fallback (a copy kernel, then the plain op); ``nccl``.

Output: a line per row, and ``all_reduce_sweep.json`` in ``--out`` (card,
torch, NCCL, date, rows).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from sgl_piecewise.distributed import launch, registry, tensor_parallel
from sgl_piecewise.internals import symm_mem

ELEMENTS = (896, 4096, 28672, 65536, 131072, 262144, 524288, 1048576)  # bf16
CHAIN = 48
REPLAYS = 20
PATHS = ("one_shot", "one_shot_copy_op", "nccl")


def chain(path: str, x: torch.Tensor, buffer: torch.Tensor, group_name: str) -> torch.Tensor:
    """``CHAIN`` all-reduces of ``x`` through ``path``, each result halved."""
    group = registry.resolve_group(group_name)
    y = x
    for _ in range(CHAIN):
        if path.startswith("one_shot"):
            y = symm_mem.one_shot_all_reduce(y, buffer, group_name) * 0.5
        else:
            z = y.clone()
            dist.all_reduce(z, group=group)
            y = z * 0.5
    return y


def time_path(tp, path: str, n: int, buffer: torch.Tensor) -> dict:
    default = symm_mem.COPY_IN_KERNEL
    symm_mem.COPY_IN_KERNEL = path == "one_shot"  # read while warming up and capturing
    try:
        return _time_path(tp, path, n, buffer)
    finally:
        symm_mem.COPY_IN_KERNEL = default


def _time_path(tp, path: str, n: int, buffer: torch.Tensor) -> dict:
    x = torch.full((n,), float(tp.rank + 1), dtype=torch.bfloat16, device=tp.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream
        for _ in range(2):
            chain(path, x, buffer, tp.group_name)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    tp.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(path, x, buffer, tp.group_name)
    torch.cuda.synchronize()
    tp.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        tp.barrier()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CHAIN)
    ok = bool(torch.equal(out.float(), torch.full_like(out.float(), 1.5)))
    return {"elements": n, "bytes": 2 * n, "path": path, "us_per_all_reduce": sorted(times)[REPLAYS // 2], "ok": ok}


def run_rank(elements: list) -> list:
    tp = tensor_parallel()
    buffer = symm_mem.allocate(2 * max(elements), tp.device, tp.group_name)
    return [time_path(tp, path, n, buffer) for n in elements for path in PATHS]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", type=int, nargs="+", default=list(ELEMENTS), help="bf16 elements per message")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2 or not symm_mem.AVAILABLE:
        p.error(f"expected 2 CUDA devices and symmetric memory, got {torch.cuda.device_count()} devices"
                f"{'' if symm_mem.AVAILABLE else ' (' + symm_mem.UNAVAILABLE_REASON + ')'}")  # fmt: skip
    rows = launch(run_rank, 2, sorted(set(args.elements)), device="cuda", timeout_s=300)[0]
    for row in rows:
        print(row, flush=True)
    result = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())), "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "chain": CHAIN, "rows": rows}  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "all_reduce_sweep.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
