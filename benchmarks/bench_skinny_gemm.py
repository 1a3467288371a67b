"""Linear layers at decode batch sizes: cuBLAS against Triton kernels (a
script, not a test).

For each weight shape of the suite's two models and M = 1 / 8 / 32 rows,
``F.linear`` (cuBLAS, and cuBLASLt by torch's preference), cuBLAS with the
weight stored ``[in, out]`` instead of ``nn.Linear``'s ``[out, in]``, and a Triton
kernel that gives each program a band of output columns and the whole
reduction, over a sweep of its launch settings (``--no-triton``: none).
``--split-k`` adds a sweep of the same kernel splitting the reduction
across programs, in one launch: the program of a column band that finishes
last sums the band's partial results in split order (so the result does not
depend on which finished first), adds the bias and writes the output.
Each time is one linear of a CUDA graph that runs the layer's linear over
24 copies of its weight in turn (as a step reads each layer's weights
once: no copy stays in L2), median of CUDA-event timings of the graph.
Prints the best setting per shape, its time against cuBLAS's, and the
copy-rate floor of the weight read.

    python benchmarks/bench_skinny_gemm.py --out results/ [--no-triton] [--split-k]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from common import blas_library, copy_rate, median_ms  # noqa: E402 (benchmarks/ is the script's folder)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split, stride_xm,
                    stride_wn, stride_om, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # Grid (column bands, splits of K). part: fp32 [splits, M, N]; count: one
    # arrival count per band, 0 between launches.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + rows[:, None] * stride_xm
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    k_end = tl.minimum(split * k_per_split + k_per_split, K)
    for k in range(split * k_per_split, k_end, BLOCK_K):
        kk = k + ks
        x = tl.load(x_rows + kk[None, :], mask=(rows[:, None] < M) & (kk[None, :] < k_end), other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=(cols[:, None] < N) & (kk[None, :] < k_end), other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    mask_out = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT:
        tile = rows[:, None] * N + cols[None, :]
        tl.store(part_ptr + split * M * N + tile, acc, mask=mask_out)
        # Partials stored before the count (barrier, release-acquire
        # increment); the last program of the band sums them and resets it.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived != num_splits - 1:
            return
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in range(0, num_splits):
            acc += tl.load(part_ptr + s * M * N + tile, mask=mask_out, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_out)


# The split-K sweep's bounds, which size its scratch: at most this many
# splits, bands of at least this many columns.
MAX_SPLIT_K = 16
MIN_BLOCK_N = 16


def k_per_split(k: int, split_k: int, block_k: int) -> int:
    """Reduction length of each of ``split_k`` splits, whole ``block_k``
    tiles; a short K gives fewer splits than asked (``cdiv(k, this)``)."""
    return triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k


def split_k_linear(x, w, b, out, scratch, block_n, block_k, split_k, warps, stages):
    """``out = F.linear(x, w, b)`` in one launch of ``_linear_kernel``, the
    reduction split ``split_k`` ways (fewer where K is short); ``scratch``:
    (fp32 partials of at least ``split_k * M * N``, zeroed int32 counts of at
    least one per band)."""
    m, k = x.shape
    n = w.shape[0]
    per_split = k_per_split(k, split_k, block_k)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, per_split))
    part, count = scratch if grid[1] > 1 else (out, out)  # one split reads neither
    _linear_kernel[grid](
        x, w, b if b is not None else w, out, part, count, m, n, k, per_split, x.stride(0), w.stride(0),
        out.stride(0), HAS_BIAS=b is not None, SPLIT=grid[1] > 1, BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def triton_linear(x, w, b, out, block_n, block_k, warps, stages):
    """The band kernel: each program a band of output columns and the whole
    reduction (``_linear_kernel`` with one split, which needs no scratch)."""
    split_k_linear(x, w, b, out, None, block_n, block_k, 1, warps, stages)


SHAPES = {  # name: (in, out, bias)
    "0.5b qkv": (896, 1152, True),
    "0.5b o": (896, 896, False),
    "0.5b gate_up": (896, 9728, False),
    "0.5b down": (4864, 896, False),
    "1b qkv": (2048, 3072, False),
    "1b o": (2048, 2048, False),
    "1b gate_up": (2048, 16384, False),
    "1b down": (8192, 2048, False),
}
COPIES = 24


def graph_ms(step) -> float:
    """One call of ``step(i)`` per weight copy, captured once; ms per call."""
    for i in range(COPIES):
        step(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(COPIES):
            step(i)
    return median_ms(graph.replay, 5, 30) / COPIES


def cublaslt_ms(x, ws, bs) -> float:
    """``F.linear`` captured with torch's cuBLASLt preference (its own
    heuristics; another set of kernels, split-K or not), restored after."""
    with blas_library("cublaslt"):
        return graph_ms(lambda i: F.linear(x, ws[i], bs[i]))


def in_out_ms(x, ws, bs) -> float:
    """cuBLAS with each weight stored ``[in, out]`` (out contiguous): the
    other operand layout, for which cuBLAS picks among other kernels."""
    wts = [w.t().contiguous() for w in ws]
    return graph_ms(lambda i: torch.mm(x, wts[i]) if bs[i] is None else torch.addmm(bs[i], x, wts[i]))


def best_setting(name, m, run, configs, want, out) -> tuple:
    """(ms, config, max |out - want|) of the fastest config that runs; each
    config checked on weight copy 0 first. (None, None, None) when none runs:
    the row records that and the sweep goes on."""
    best = None
    for config in configs:
        try:
            run(0, config)
            err = float((out.float() - want.float()).abs().max())
            ms = graph_ms(lambda i, c=config: run(i, c))
        except Exception as e:  # out of shared memory or registers: not a candidate
            print(f"  skip {name} m={m} {config}: {type(e).__name__}", file=sys.stderr)
            continue
        if best is None or ms < best[0]:
            best = (ms, config, err)
    if best is None:
        print(f"  no setting of {name} m={m} ran", file=sys.stderr)
        return None, None, None
    return best


def split_k_configs(k: int) -> list:
    """(block_n, block_k, split_k, warps, stages); of the split counts that
    give the same number of splits (a short K gives fewer than asked), only
    the first."""
    configs, seen = [], set()
    settings = itertools.product((MIN_BLOCK_N, 32, 64), (128, 256), (1, 2, 4, 8, MAX_SPLIT_K), (3, 4))
    for block_n, block_k, split_k, stages in settings:
        splits = triton.cdiv(k, k_per_split(k, split_k, block_k))
        if (block_n, block_k, splits, stages) not in seen:
            seen.add((block_n, block_k, splits, stages))
            configs.append((block_n, block_k, split_k, 4, stages))
    return configs


def sweep(name, m, rate, triton_sweep: bool = True, split_k: bool = False) -> dict:
    k, n, has_bias = SHAPES[name]
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(COPIES)]
    bs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None for _ in range(COPIES)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x, ws[0], bs[0])
    row = {"cublas_ms": graph_ms(lambda i: F.linear(x, ws[i], bs[i])), "floor_ms": 1e3 * n * k * 2 / rate}
    row["cublaslt_ms"] = cublaslt_ms(x, ws, bs)
    row["cublas_in_out_ms"] = in_out_ms(x, ws, bs)
    if split_k:
        scratch = (torch.empty(MAX_SPLIT_K * m * n, device="cuda", dtype=torch.float32),
                   torch.zeros(triton.cdiv(n, MIN_BLOCK_N), device="cuda", dtype=torch.int32))  # fmt: skip
        run = lambda i, c: split_k_linear(x, ws[i], bs[i], out, scratch, *c)  # noqa: E731
        best = best_setting(name, m, run, split_k_configs(k), want, out)
        row.update(split_k_ms=best[0], split_k_config=best[1], split_k_max_err=best[2])
    if triton_sweep:
        configs = itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (3, 4, 6))
        run = lambda i, c: triton_linear(x, ws[i], bs[i], out, *c)  # noqa: E731
        best = best_setting(name, m, run, configs, want, out)
        row.update(triton_ms=best[0], triton_config=best[1], triton_max_err=best[2])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--m", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--no-triton", action="store_true", help="no sweep of the band kernel (no split-K)")
    p.add_argument("--split-k", action="store_true", help="also sweep the split-K kernel")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rate = copy_rate()
    result = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "copy_rate_Bps": rate, "rows": {}}  # fmt: skip
    for name in args.shapes:
        for m in args.m:
            row = sweep(name, m, rate, triton_sweep=not args.no_triton, split_k=args.split_k)
            result["rows"][f"{name} m={m}"] = row
            us = {k: "none ran" if v is None else f"{1e3 * v:6.2f}" for k, v in row.items() if k.endswith("_ms")}
            print(f"{name:14s} m={m:3d} µs {us}", {k: v for k, v in row.items() if not k.endswith("_ms")}, flush=True)
    json.dump(result, open(os.path.join(args.out, "skinny_gemm.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
