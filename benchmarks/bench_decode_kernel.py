"""Decode-attention kernel benchmark (a script, not a test): our Triton
split-KV kernel over the paged pool against FlashInfer's paged decode kernels
and PyTorch SDPA, as time and as achieved bandwidth
against the card's copy rate.

    python benchmarks/bench_decode_kernel.py --out results/           # the table
    python benchmarks/bench_decode_kernel.py --sweep --out results/   # tuning data

Shape: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128), bf16,
batch 1 / 32 / 128, context 1k / 4k / 16k, page size 1 (SGLang's default),
slots shuffled through the pool. Bytes = the K and V rows read
(bs * ctx * Hkv * D * 2 * 2) + q and out.

Timing: one CUDA graph holds ``CALLS_PER_GRAPH`` back-to-back calls, so
launch gaps are amortised; the calls rotate over enough copies of the batch
(disjoint slots, same shape) that each reads K/V from HBM, not from the L2
cache (as FlashInfer's own benchmarks do with ``cold_l2_cache``). Median of
the replays, divided by the calls.

FlashInfer is timed in both of its decode paths (CUDA-core decode kernel,
and ``use_tensor_cores=True``, the prefill kernel SGLang picks for grouped
heads); the yardstick is the faster of the two at each point.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from common import copy_rate, median_ms  # noqa: E402 (benchmarks/ is the script's folder)

from sgl_piecewise.backends.lengths import cumsum_with_zero
from sgl_piecewise.backends.triton_kernels import choose_num_kv_splits, decode_attention
from sgl_piecewise.backends.triton_kernels.decode import DecodeLaunch, grid_kv_splits

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
POINTS = list(itertools.product((1, 32, 128), (1024, 4096, 16384)))
# Rotate copies until the batches read at least this much: over 4x the L2
# cache of an H100/H200 (50 MiB), so a call never finds its K/V cached.
COLD_BYTES = 256 << 20
CALLS_PER_GRAPH = 32
MAX_KV_SPLITS = 64  # scratch of our kernel in the table; the grid is batch-aware
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
SWEEP_LAUNCHES = [DecodeLaunch(n, w, s, cap_splits=False) for n, w, s in
                  ((32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 2))]  # fmt: skip


@dataclass
class Batch:
    """One copy of the decode batch: its queries, page table and output."""

    q: torch.Tensor  # [bs, HQ, D]
    kv_indptr: torch.Tensor  # [bs + 1] int32
    kv_indices: torch.Tensor  # [bs * ctx] int32 slots
    out: torch.Tensor  # [bs, HQ, D]


@dataclass
class Point:
    bs: int
    ctx: int
    k_cache: torch.Tensor  # [slots, HKV, D]
    v_cache: torch.Tensor
    batches: list[Batch]  # rotated copies, disjoint slots

    @property
    def kv_bytes(self) -> int:
        return 2 * self.bs * self.ctx * HKV * D * DTYPE.itemsize + 2 * self.bs * HQ * D * DTYPE.itemsize


def make_point(bs: int, ctx: int) -> Point:
    per_copy = 2 * bs * ctx * HKV * D * DTYPE.itemsize
    copies = max(1, math.ceil(COLD_BYTES / per_copy))
    slots = copies * bs * ctx
    k_cache = torch.randn(slots + 1, HKV, D, device="cuda", dtype=DTYPE)  # slot 0: the dummy
    v_cache = torch.randn_like(k_cache)
    order = (torch.randperm(slots, device="cuda") + 1).to(torch.int32).view(copies, bs * ctx)
    kv_indptr = cumsum_with_zero(torch.full((bs,), ctx, dtype=torch.int32, device="cuda"))
    batches = [
        Batch(torch.randn(bs, HQ, D, device="cuda", dtype=DTYPE), kv_indptr.clone(), order[c].contiguous(),
              torch.empty(bs, HQ, D, device="cuda", dtype=DTYPE))
        for c in range(copies)
    ]  # fmt: skip
    return Point(bs, ctx, k_cache, v_cache, batches)


def graph_us(point: Point, call: Callable[[Batch], None]) -> float:
    """Device time of one ``call``, µs: replays of a graph of rotated calls."""
    for b in point.batches:  # warm-up: compiles, lazy allocations
        call(b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            call(point.batches[i % len(point.batches)])
    ms = median_ms(graph.replay, 3, 20)
    del graph
    return ms * 1e3 / CALLS_PER_GRAPH


# ---- contenders: each returns call(batch) ----------------------------------
def ours(point: Point, max_kv_splits: int, launch: Optional[DecodeLaunch] = None,
         fixed_splits: Optional[int] = None) -> Callable[[Batch], None]:  # fmt: skip
    """Our kernel; ``fixed_splits`` forces that many splits per request (the
    sweep), else the library's choice (:func:`choose_num_kv_splits`)."""
    bs = point.bs
    logits = torch.empty(bs, HQ, max_kv_splits, D, device="cuda", dtype=torch.float32)
    lse = torch.empty(bs, HQ, max_kv_splits, device="cuda", dtype=torch.float32)
    counts = torch.zeros(bs, HQ, device="cuda", dtype=torch.int32)
    kv_lens = torch.full((bs,), point.ctx, dtype=torch.int32, device="cuda")
    splits = choose_num_kv_splits(kv_lens, max_kv_splits, torch.empty_like(kv_lens))
    if fixed_splits is not None:
        splits.fill_(fixed_splits)

    def call(b: Batch) -> None:
        decode_attention(b.q, point.k_cache, point.v_cache, b.out, b.kv_indptr, b.kv_indices,
                         logits, lse, counts, splits, max_kv_splits, D**-0.5, launch)  # fmt: skip

    return call


def flashinfer(point: Point, tensor_cores: bool) -> Callable[[Batch], None]:
    """FlashInfer's graph-mode decode wrapper per batch copy, planned once
    (plan() is host work outside the graph, as in serving)."""
    import flashinfer as fi

    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")  # runs are serial: shared
    last_page_len = torch.ones(point.bs, dtype=torch.int32, device="cuda")
    wrappers = {}
    for b in point.batches:
        w = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=b.kv_indptr, paged_kv_indices_buffer=b.kv_indices,
            paged_kv_last_page_len_buffer=last_page_len, backend="fa2" if tensor_cores else "auto",
        )  # fmt: skip
        w.plan(b.kv_indptr, b.kv_indices, last_page_len, HQ, HKV, D, 1,
               q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=D**-0.5)  # fmt: skip
        wrappers[id(b)] = w
    paged = (point.k_cache.unsqueeze(1), point.v_cache.unsqueeze(1))  # [pages, page_size=1, HKV, D]

    def call(b: Batch) -> None:
        wrappers[id(b)].run(b.q, paged, out=b.out)

    return call


def sdpa(point: Point) -> Callable[[Batch], None]:
    """PyTorch SDPA over each copy's keys laid out contiguously per request."""
    kv = {}
    for b in point.batches:
        order = b.kv_indices.long().view(point.bs, point.ctx)
        kv[id(b)] = tuple(c[order].transpose(1, 2).contiguous() for c in (point.k_cache, point.v_cache))

    def call(b: Batch) -> None:
        k, v = kv[id(b)]
        b.out.copy_(F.scaled_dot_product_attention(b.q.unsqueeze(2), k, v, scale=D**-0.5,
                                                   enable_gqa=True).squeeze(2))  # fmt: skip

    return call


def max_err(point: Point, call: Callable[[Batch], None], want: torch.Tensor) -> float:
    b = point.batches[0]
    call(b)
    return (b.out.float() - want).abs().max().item()


def reference_out(point: Point) -> torch.Tensor:
    b = point.batches[0]
    sdpa_one = sdpa(Point(point.bs, point.ctx, point.k_cache, point.v_cache, [b]))
    sdpa_one(b)
    return b.out.float().clone()


# ---- runs -------------------------------------------------------------------
def table_row(point: Point, rate: float, have_flashinfer: bool) -> dict:
    want = reference_out(point)
    contenders = {"ours": ours(point, MAX_KV_SPLITS), "sdpa": sdpa(point)}
    if have_flashinfer:
        contenders["flashinfer"] = flashinfer(point, tensor_cores=False)
        contenders["flashinfer_tc"] = flashinfer(point, tensor_cores=True)
    splits = grid_kv_splits(point.bs, HQ, HKV, DTYPE, MAX_KV_SPLITS, torch.device("cuda"), head_dim=D)
    row = {"bs": point.bs, "ctx": point.ctx, "bytes": point.kv_bytes, "copies": len(point.batches),
           "ours_grid_splits": splits}  # fmt: skip
    for name, call in contenders.items():
        row[f"{name}_max_abs_err"] = max_err(point, call, want)
        row[f"{name}_us"] = graph_us(point, call)
        row[f"{name}_frac_of_copy_rate"] = point.kv_bytes / (row[f"{name}_us"] / 1e6) / rate
    if have_flashinfer:
        row["flashinfer_best_us"] = min(row["flashinfer_us"], row["flashinfer_tc_us"])
        row["ours_over_flashinfer"] = row["ours_us"] / row["flashinfer_best_us"]
    row["ours_over_sdpa"] = row["ours_us"] / row["sdpa_us"]
    return row


def sweep_rows(point: Point) -> list[dict]:
    """Our kernel at fixed split counts × launch settings (the tuning data)."""
    rows = []
    for launch, splits in itertools.product(SWEEP_LAUNCHES, SWEEP_SPLITS):
        if splits > 1 and point.ctx // splits < 32:
            continue
        us = graph_us(point, ours(point, splits, launch, fixed_splits=splits))
        rows.append({"bs": point.bs, "ctx": point.ctx, "splits": splits, "block_n": launch.block_n,
                     "num_warps": launch.num_warps, "num_stages": launch.num_stages, "us": us})  # fmt: skip
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--sweep", action="store_true", help="tuning data instead of the table")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    try:
        import flashinfer  # noqa: F401

        have_flashinfer = True
    except ImportError:
        have_flashinfer = False
    rate = copy_rate()
    rows = []
    for bs, ctx in POINTS:
        point = make_point(bs, ctx)
        new = sweep_rows(point) if args.sweep else [table_row(point, rate, have_flashinfer)]
        for r in new:
            print(json.dumps(r), flush=True)
        rows += new
        del point
        torch.cuda.empty_cache()
    info = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_rate_Bps": rate,
            "flashinfer": _flashinfer_version() if have_flashinfer else None,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}  # fmt: skip
    name = "decode_kernel_sweep.json" if args.sweep else "decode_kernel.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(info, f, indent=1)


def _flashinfer_version() -> str:
    import flashinfer

    return flashinfer.__version__


if __name__ == "__main__":
    main()
