"""The gated MLP at decode batch sizes: cuBLAS and Inductor against two Triton
kernels that launch half as many kernels (a script, not a test).

A decode layer's MLP launches four kernels: the ``gate_up`` GEMM, SiLU·mul
(Inductor's), the ``down`` GEMM and cuBLAS's split-K reduce. The Triton pair
launches two: a ``gate_up`` GEMM that applies SiLU·mul before it stores
(rounding where the unfused ops round), and a split-K ``down`` GEMM whose
last-arriving program of each column block sums the splits' partials in
split order (deterministic; no separate reduce). For each of the suite's two
shapes and 1 / 8 / 32 rows it times, in µs per layer (one CUDA graph over
the model's layers, each with its own weights, median of CUDA-event timings
of the graph divided by the layers): the unfused path, cuBLAS's two GEMMs
alone, and the best launch setting of each Triton kernel, with its largest
difference to the unfused path's output.

    python benchmarks/bench_fused_mlp.py --out results/
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from common import best_launch, card_info, graph_us_per_layer, measure_rows, write_json  # noqa: E402 (benchmarks/ is the script's folder)

# name: (hidden, intermediate, layers)
SHAPES = {"0.5b": (896, 4864, 24), "1b": (2048, 8192, 16)}
# Launch settings swept: (columns per program, reduction tile, warps, stages).
GATE_UP_LAUNCHES = list(itertools.product((32, 64), (64, 128, 256), (4,), (3, 4)))
# (splits, output columns per program, reduction tile, warps, stages).
DOWN_LAUNCHES = list(itertools.product((1, 4, 8, 16), (32, 64), (128, 256), (4,), (3, 4)))


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, h_ptr, M, K, F_DIM, stride_xm, stride_wn, stride_hm,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """``h[:, cols] = silu(x @ gate[cols].T) * (x @ up[cols].T)``; gate is
    rows ``[0, F)`` of ``w``, up rows ``[F, 2F)``."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    mask_m, mask_n = rows < M, cols < F_DIM
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = k0 + ks < K
        x_mask, w_mask = mask_m[:, None] & mask_k[None, :], mask_n[:, None] & mask_k[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k0 + ks[None, :], mask=x_mask, other=0.0)
        gate = tl.load(w_ptr + cols[:, None] * stride_wn + k0 + ks[None, :], mask=w_mask, other=0.0)
        up = tl.load(w_ptr + (cols[:, None] + F_DIM) * stride_wn + k0 + ks[None, :], mask=w_mask, other=0.0)
        acc_gate = tl.dot(x, tl.trans(gate), acc_gate)
        acc_up = tl.dot(x, tl.trans(up), acc_up)
    # Round where the unfused ops round: the GEMM's output, SiLU's, the product.
    dtype = h_ptr.dtype.element_ty
    g = acc_gate.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    h = (silu * acc_up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(h_ptr + rows[:, None] * stride_hm + cols[None, :], h, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _split_k_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, K, N, stride_xm, stride_wn, stride_om,
                    K_PER_SPLIT: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """``out = x @ w.T`` with the reduction in ``SPLITS`` ranges; the last
    program of a column block to finish sums the partials in split order and
    resets its arrival count to 0."""
    block_n, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    mask_m, mask_n = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        mask_k = k0 + ks < K
        x_mask, w_mask = mask_m[:, None] & mask_k[None, :], mask_n[:, None] & mask_k[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k0 + ks[None, :], mask=x_mask, other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + k0 + ks[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    out_rows = out_ptr + rows[:, None] * stride_om + cols[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    if SPLITS == 1:
        tl.store(out_rows, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        return
    part_rows = part_ptr + rows[:, None] * N + cols[None, :]
    tl.store(part_rows + split * BLOCK_M * N, acc, mask=mask_n[None, :])
    # Partials stored before the count: barrier, then a release-acquire increment.
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + block_n, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in range(0, SPLITS):  # in split order, whichever arrived last
            total += tl.load(part_rows + s * BLOCK_M * N, mask=mask_n[None, :], other=0.0, cache_modifier=".cg")
        tl.store(out_rows, total.to(out_ptr.dtype.element_ty), mask=out_mask)
        tl.atomic_xchg(count_ptr + block_n, 0, sem="relaxed", scope="gpu")


def block_m(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))  # tl.dot needs >= 16 rows


def gate_up_silu(x, w, h, launch) -> None:
    block_n, block_k, warps, stages = launch
    rows, k = x.shape
    f = w.shape[0] // 2
    _gate_up_silu_kernel[(triton.cdiv(f, block_n),)](
        x, w, h, rows, k, f, x.stride(0), w.stride(0), h.stride(0),
        BLOCK_M=block_m(rows), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def split_k(x, w, out, scratch, launch) -> None:
    splits, block_n, block_k, warps, stages = launch
    parts, counts = scratch
    rows, k = x.shape
    n = w.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    _split_k_kernel[(triton.cdiv(n, block_n), splits)](
        x, w, out, parts, counts, rows, k, n, x.stride(0), w.stride(0), out.stride(0),
        K_PER_SPLIT=k_per_split, SPLITS=splits, BLOCK_M=block_m(rows), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


def measure(shape: str, rows: int) -> dict:
    hidden, ffn, layers = SHAPES[shape]
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gate_up_ws = [torch.randn(2 * ffn, hidden, device=dev, dtype=bf16) * 0.02 for _ in range(layers)]
    down_ws = [torch.randn(hidden, ffn, device=dev, dtype=bf16) * 0.02 for _ in range(layers)]
    x = torch.randn(rows, hidden, device=dev, dtype=bf16)
    h_in = torch.randn(rows, ffn, device=dev, dtype=bf16)
    h, out = torch.empty(rows, ffn, device=dev, dtype=bf16), torch.empty(rows, hidden, device=dev, dtype=bf16)
    scratch = (torch.empty(max(s for s, *_ in DOWN_LAUNCHES) * block_m(rows) * hidden, device=dev),
               torch.zeros(triton.cdiv(hidden, 32), device=dev, dtype=torch.int32))  # fmt: skip
    silu_mul = torch.compile(lambda gu: F.silu(gu[:, :ffn]) * gu[:, ffn:])

    def unfused() -> None:
        for gate_up_w, down_w in zip(gate_up_ws, down_ws):
            F.linear(silu_mul(F.linear(x, gate_up_w)), down_w)

    row = dict(shape=shape, rows=rows, unfused_us=graph_us_per_layer(unfused, layers),
               cublas_gate_up_us=graph_us_per_layer(lambda: [F.linear(x, w) for w in gate_up_ws], layers),
               cublas_down_us=graph_us_per_layer(lambda: [F.linear(h_in, w) for w in down_ws], layers))  # fmt: skip
    row["triton_gate_up_silu"] = best_launch(
        lambda launch: lambda: [gate_up_silu(x, w, h, launch) for w in gate_up_ws], GATE_UP_LAUNCHES, layers
    )
    row["triton_split_k_down"] = best_launch(
        lambda launch: lambda: [split_k(h_in, w, out, scratch, launch) for w in down_ws], DOWN_LAUNCHES, layers
    )
    gate_up_silu(x, gate_up_ws[0], h, row["triton_gate_up_silu"]["launch"])
    row["gate_up_silu_maxdiff"] = float((h.float() - silu_mul(F.linear(x, gate_up_ws[0])).float()).abs().max())
    split_k(h_in, down_ws[0], out, scratch, row["triton_split_k_down"]["launch"])
    row["split_k_maxdiff"] = float((out.float() - F.linear(h_in, down_ws[0]).float()).abs().max())
    row["counts_left_zero"] = bool((scratch[1] == 0).all())
    fused = row["triton_gate_up_silu"]["us_per_layer"] + row["triton_split_k_down"]["us_per_layer"]
    row["fused_over_unfused"] = fused / row["unfused_us"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for bench_fused_mlp.json")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    args = p.parse_args()
    rows = measure_rows(measure, SHAPES, args.rows)
    info = card_info(rows=rows)
    write_json(args.out, "bench_fused_mlp.json", info)


if __name__ == "__main__":
    main()
