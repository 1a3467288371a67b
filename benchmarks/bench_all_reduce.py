"""All-reduce inside a CUDA graph on two GPUs, per message size: torch's
one-shot and two-shot symmetric-memory kernels against NCCL (a script, not
a test).

    python benchmarks/bench_all_reduce.py --out results/

What sets the library's ``ONE_SHOT_MAX_BYTES`` and ``SMALL_ALL_REDUCE_MAX_BYTES``. Two ranks
(``distributed.launch``), each with one symmetric-memory buffer for the
largest message (``internals/symm_mem.py``, never multicast). Per message
size and path, one CUDA graph holds 48 all-reduces in a row, as a 24-layer
decode step does, each followed by a halving so every one reads the last
one's result; the graph is replayed 20 times between host barriers and the
median replay over 48 is the time per all-reduce (the halving included). Each
row checks the sum: ranks holding 1 and 2 give 1.5 after every step.

Paths: ``one_shot``, the library's (the op copies its input into the buffer
in its own kernel, ``one_shot_all_reduce_copy``); ``one_shot_copy_op``, its
fallback (a copy kernel, then the plain op); ``two_shot``, the library's
for larger messages (a copy into the buffer, then torch's
``two_shot_all_reduce_out``: each rank sums one share of the message
from every peer's buffer, then the ranks exchange the summed shares; peer
loads, stores and signal pads, no multicast), where this torch has it;
``nccl``.

``--fused-norm``: what the all-reduce after a row-parallel projection is
followed by in a decoder layer, the residual add and the next RMSNorm, per
hidden size and token count, as 48 in a row in one CUDA graph: the library's
one-shot all-reduce then the add and the norm as Inductor fuses them (one
kernel), against FlashInfer's ``trtllm_allreduce_fusion``: its all-reduce
alone then the library's add + RMSNorm kernel (the op's path for wide
rows), and all three in one kernel (its Lamport one-shot protocol over its
own symmetric-memory workspace; needs ``flashinfer``). Each row gives the largest difference of
the last residual and norm from the library's, over the norm's largest value.

Output: a line per row, and ``all_reduce_sweep.json`` in ``--out`` (card,
torch, NCCL, date, rows; ``fused_norm_rows`` with ``--fused-norm``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch
import torch.distributed as dist

from sgl_piecewise.distributed import fused_norm, launch, registry, tensor_parallel
from sgl_piecewise.internals import symm_mem
from sgl_piecewise.models.norm import rms_norm
from sgl_piecewise.ops.kernels import elementwise

ELEMENTS = (896, 4096, 28672, 65536, 131072, 262144, 524288, 1048576, 2097152, 4194304)  # bf16
CHAIN = 48
REPLAYS = 20
PATHS = ("one_shot", "one_shot_copy_op", "two_shot", "nccl")
FUSED_HIDDEN = (896, 2048, 4096)  # the 0.5B, 1B and 8B shapes
FUSED_TOKENS = (1, 8, 32)
FUSED_PATHS = ("one_shot_then_norm", "flashinfer_all_reduce_then_norm", "flashinfer_fused")
EPS = 1e-5


def chain(path: str, x: torch.Tensor, buffer: torch.Tensor, group_name: str) -> torch.Tensor:
    """``CHAIN`` all-reduces of ``x`` through ``path``, each result halved."""
    group = registry.resolve_group(group_name)
    y = x
    for _ in range(CHAIN):
        if path.startswith("one_shot"):
            y = symm_mem.one_shot_all_reduce(y, buffer, group_name) * 0.5
        elif path == "two_shot":
            y = symm_mem.two_shot_all_reduce(y, buffer, group_name) * 0.5
        else:
            z = y.clone()
            dist.all_reduce(z, group=group)
            y = z * 0.5
    return y


def paths() -> tuple:
    """The all-reduce paths this torch runs (``two_shot`` where it has the op)."""
    return tuple(p for p in PATHS if p != "two_shot" or symm_mem.TWO_SHOT)


def time_path(tp, path: str, n: int, buffer: torch.Tensor) -> dict:
    default = symm_mem.COPY_IN_KERNEL
    symm_mem.COPY_IN_KERNEL = path == "one_shot"  # read while warming up and capturing
    try:
        return _time_path(tp, path, n, buffer)
    finally:
        symm_mem.COPY_IN_KERNEL = default


def _time_path(tp, path: str, n: int, buffer: torch.Tensor) -> dict:
    x = torch.full((n,), float(tp.rank + 1), dtype=torch.bfloat16, device=tp.device)
    out, us = replay_us(tp, lambda: chain(path, x, buffer, tp.group_name), CHAIN)
    ok = bool(torch.equal(out.float(), torch.full_like(out.float(), 1.5)))
    return {"elements": n, "bytes": 2 * n, "path": path, "us_per_all_reduce": us, "ok": ok}


def replay_us(tp, fn, calls: int) -> tuple:
    """``fn``'s result and its median time per call (of ``calls``) when
    captured in one CUDA graph, warmed up off the capture stream first."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    tp.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
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
        times.append(start.elapsed_time(end) * 1000 / calls)
    return out, sorted(times)[REPLAYS // 2]


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor) -> tuple:
    """The residual add and RMSNorm of a decoder layer (``models/norm.py``)."""
    x = x + r
    return x, rms_norm(x, weight, EPS)


def fused_norm_rows(tp, buffer: torch.Tensor) -> list:
    """Per hidden size and token count: the library's all-reduce then the
    add and norm against FlashInfer's fused kernel (module docstring)."""
    fused_norm.build()
    library_all_reduce = functools.partial(symm_mem.one_shot_all_reduce, buffer=buffer, group_name=tp.group_name)
    rows = []
    for hidden in FUSED_HIDDEN:
        torch.compiler.reset()  # a compile per width and token count: within Dynamo's recompile limit
        add_norm = torch.compile(add_rms_norm, dynamic=False, fullgraph=True)
        workspace = fused_norm.allocate(tp.rank, tp.size, max(FUSED_TOKENS), hidden, torch.bfloat16, tp.device,
                                        tp.group_name)  # fmt: skip
        paths = {
            "one_shot_then_norm": functools.partial(then_norm, add_norm, library_all_reduce),
            "flashinfer_all_reduce_then_norm": functools.partial(split_norm, workspace),
            "flashinfer_fused": functools.partial(fused_norm.add_rms_norm, workspace, eps=EPS),
        }
        for tokens in FUSED_TOKENS:
            rows += fused_norm_case(tp, hidden, tokens, paths)
    return rows


def split_norm(workspace, p: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple:
    """FlashInfer's all-reduce alone over the workspace, then the library's
    add + RMSNorm kernel: the op's path for wide rows (``models/norm.py``)."""
    return elementwise.add_rms_norm(x, fused_norm.all_reduce(workspace, p), weight, EPS)


def then_norm(add_norm, all_reduce, p: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple:
    """``all_reduce(p)``, then the compiled residual add and norm."""
    return add_norm(x, all_reduce(p), weight)


def fused_norm_case(tp, hidden: int, tokens: int, paths: dict) -> list:
    """A row per path: ``CHAIN`` steps of ``path(partial, residual, weight)
    -> (residual, normed)`` in one graph, each rank's partials its own."""
    seeded = torch.Generator(device=tp.device).manual_seed(tp.rank)
    partials = [0.1 * torch.randn(tokens, hidden, device=tp.device, dtype=torch.bfloat16, generator=seeded)
                for _ in range(CHAIN)]  # fmt: skip
    weight = torch.linspace(0.5, 1.5, hidden, device=tp.device, dtype=torch.bfloat16)
    x0 = torch.linspace(-1, 1, tokens * hidden, device=tp.device, dtype=torch.bfloat16).view(tokens, hidden)

    def steps(path):
        x, normed = x0, None
        for p in partials:
            x, normed = path(p, x, weight)
        return x, normed

    timed = {name: replay_us(tp, lambda path=path: steps(path), CHAIN) for name, path in paths.items()}
    (x_ref, normed_ref), _ = timed[FUSED_PATHS[0]]
    scale = normed_ref.float().abs().max().item()
    rows = []
    for name, ((x, normed), us) in timed.items():
        diff = max(
            (x.float() - x_ref.float()).abs().max().item(), (normed.float() - normed_ref.float()).abs().max().item()
        )
        rows.append(
            {"hidden": hidden, "tokens": tokens, "path": name, "us_per_call": us, "max_diff_over_scale": diff / scale}
        )
    return rows


def run_rank(elements: list, fused_norm: bool) -> dict:
    tp = tensor_parallel()
    nbytes = 2 * max(max(elements), max(FUSED_HIDDEN) * max(FUSED_TOKENS) if fused_norm else 0)
    buffer = symm_mem.allocate(nbytes, tp.device, tp.group_name)
    rows = [time_path(tp, path, n, buffer) for n in elements for path in paths()]
    return {"rows": rows, "fused_norm_rows": fused_norm_rows(tp, buffer) if fused_norm else []}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", type=int, nargs="+", default=list(ELEMENTS), help="bf16 elements per message")
    p.add_argument(
        "--fused-norm", action="store_true", help="also all-reduce + add + RMSNorm against FlashInfer's fusion"
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.fused_norm and not fused_norm.AVAILABLE:
        p.error("--fused-norm: expected the flashinfer package, got none installed")
    if torch.cuda.device_count() < 2 or not symm_mem.AVAILABLE:
        p.error(f"expected 2 CUDA devices and symmetric memory, got {torch.cuda.device_count()} devices"
                f"{'' if symm_mem.AVAILABLE else ' (' + symm_mem.UNAVAILABLE_REASON + ')'}")  # fmt: skip
    ranks = launch(run_rank, 2, sorted(set(args.elements)), args.fused_norm, device="cuda", timeout_s=600)
    rows, fused_rows = ranks[0]["rows"], ranks[0]["fused_norm_rows"]
    for row in rows + fused_rows:
        print(row, flush=True)
    result = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())), "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "chain": CHAIN, "rows": rows}  # fmt: skip
    if args.fused_norm:
        result["fused_norm_rows"] = fused_rows
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "all_reduce_sweep.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
