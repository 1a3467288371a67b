"""A decode layer's residual add and RMSNorm folded into the GEMM after them
(a script, not a test).

In a whole-model decode graph each layer launches two add+RMSNorm kernels
(Inductor's), each feeding a cuBLAS GEMM (``qkv_proj``, ``gate_up_proj``),
and a SiLU·mul kernel after ``gate_up_proj``. At decode batch sizes each of
those small kernels costs 1.1-1.5 µs on an H100, however little it reads.
Here one Triton kernel does the add, the norm and the GEMM (and SiLU·mul for
``gate_up``): every program reads the rows (a few KB, from L2 after the
first) and its band of the weight; the first program stores the sum for the
next residual add.

Two ways to apply the norm are timed:

* ``norm_first``: a first pass over the row sums its squares, then the GEMM
  reads the normalised row, rounded where the unfused ops round;
* ``scale_after``: one pass; the GEMM reads ``weight * row`` and its result is
  multiplied by the row's ``rsqrt(mean + eps)`` at the end (no pass before
  the weight loads, but the norm's output is not rounded before the GEMM).

For both shapes and 1 / 8 / 32 rows: µs per layer (one CUDA graph over the
model's layers, each with its own weights) of the unfused kernels and of the
best launch setting of each fused variant, and the largest difference of
each to the unfused output.

    python benchmarks/bench_norm_linear.py --out results/
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from common import best_launch, card_info, graph_us_per_layer, measure_rows, write_json  # noqa: E402 (benchmarks/ is the script's folder)

# name: (hidden, qkv width, intermediate, layers)
SHAPES = {"0.5b": (896, 1152, 4864, 24), "1b": (2048, 3072, 8192, 16)}
# (output columns per program, reduction tile, warps, stages)
LAUNCHES = list(itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 4)))
EPS = 1e-6


@triton.jit
def _norm_linear_kernel(x_ptr, d_ptr, h_ptr, g_ptr, w_ptr, b_ptr, y_ptr, M, K, N, stride_x, stride_d, stride_h,
                        stride_w, stride_y, eps, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                        SCALE_AFTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):  # fmt: skip
    """``h = x + d``; ``y = rms_norm(h) @ w.T (+ b)``, or with ``GATED``
    ``silu(n @ gate.T) * (n @ up.T)`` (gate rows ``[0, N)`` of ``w``, up
    rows ``[N, 2N)``). Program 0 stores ``h``."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    mask_m, mask_n = rows < M, cols < N
    dtype = y_ptr.dtype.element_ty
    if not SCALE_AFTER:  # the row's sum of squares before the GEMM
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            m = mask_m[:, None] & (k0 + ks < K)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + k0 + ks[None, :], mask=m, other=0.0)
            d = tl.load(d_ptr + rows[:, None] * stride_d + k0 + ks[None, :], mask=m, other=0.0)
            h = (x.to(tl.float32) + d.to(tl.float32)).to(dtype).to(tl.float32)
            sq += tl.sum(h * h, axis=1)
        inv = tl.math.rsqrt(sq / K + eps)
    else:
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = k0 + ks < K
        m = mask_m[:, None] & mask_k[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + k0 + ks[None, :], mask=m, other=0.0)
        d = tl.load(d_ptr + rows[:, None] * stride_d + k0 + ks[None, :], mask=m, other=0.0)
        h = (x.to(tl.float32) + d.to(tl.float32)).to(dtype)
        if pid == 0:
            tl.store(h_ptr + rows[:, None] * stride_h + k0 + ks[None, :], h, mask=m)
        g = tl.load(g_ptr + k0 + ks, mask=mask_k, other=0.0).to(tl.float32)
        hf = h.to(tl.float32)
        if SCALE_AFTER:
            sq += tl.sum(hf * hf, axis=1)
            n = (g[None, :] * hf).to(dtype)
        else:
            n = (g[None, :] * (hf * inv[:, None]).to(dtype).to(tl.float32)).to(dtype)
        w_mask = mask_n[:, None] & mask_k[None, :]
        w = tl.load(w_ptr + cols[:, None] * stride_w + k0 + ks[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(n, tl.trans(w), acc)
        if GATED:
            up = tl.load(w_ptr + (cols[:, None] + N) * stride_w + k0 + ks[None, :], mask=w_mask, other=0.0)
            acc_up = tl.dot(n, tl.trans(up), acc_up)
    if SCALE_AFTER:
        inv = tl.math.rsqrt(sq / K + eps)
        acc = acc * inv[:, None]
        acc_up = acc_up * inv[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GATED:
        a = acc.to(dtype).to(tl.float32)
        silu = (a / (1.0 + tl.exp(-a))).to(dtype).to(tl.float32)
        out = (silu * acc_up.to(dtype).to(tl.float32)).to(dtype)
    else:
        out = acc.to(dtype)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], out, mask=mask_m[:, None] & mask_n[None, :])


def norm_linear(x, d, h, g, w, b, y, gated: bool, scale_after: bool, launch) -> None:
    block_n, block_k, warps, stages = launch
    rows, k = x.shape
    n = y.shape[1]
    _norm_linear_kernel[(triton.cdiv(n, block_n),)](
        x, d, h, g, w, b if b is not None else w, y, rows, k, n, x.stride(0), d.stride(0), h.stride(0),
        w.stride(0), y.stride(0), EPS, HAS_BIAS=b is not None, GATED=gated, SCALE_AFTER=scale_after,
        BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip


def add_rms_norm(x, d, g):
    h = x + d
    hf = h.float()
    return h, g * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)


def every_layer(x, d, h, norm_ws, ws, bs, out, gated, scale_after):
    """A launch setting -> one call running the fused kernel over every layer."""
    return lambda launch: lambda: [norm_linear(x, d, h, g, w, b, out, gated, scale_after, launch)
                                   for g, w, b in zip(norm_ws, ws, bs)]  # fmt: skip


def measure(shape: str, rows: int) -> dict:
    hidden, qkv_width, ffn, layers = SHAPES[shape]
    dev, bf16 = torch.device("cuda"), torch.bfloat16

    def weights(out_features, in_features):
        return [torch.randn(out_features, in_features, device=dev, dtype=bf16) * 0.02 for _ in range(layers)]

    qkv_ws, gate_up_ws = weights(qkv_width, hidden), weights(2 * ffn, hidden)
    qkv_bs = [torch.randn(qkv_width, device=dev, dtype=bf16) * 0.02 for _ in range(layers)]
    norm_ws = [1 + 0.1 * torch.randn(hidden, device=dev, dtype=bf16) for _ in range(layers)]
    x, d = torch.randn(rows, hidden, device=dev, dtype=bf16), torch.randn(rows, hidden, device=dev, dtype=bf16)
    h = torch.empty_like(x)
    qkv_out = torch.empty(rows, qkv_width, device=dev, dtype=bf16)
    act = torch.empty(rows, ffn, device=dev, dtype=bf16)
    compiled_norm = torch.compile(add_rms_norm, dynamic=False)
    silu_mul = torch.compile(lambda gu: F.silu(gu[:, :ffn]) * gu[:, ffn:], dynamic=False)

    def unfused_qkv():
        for g, w, b in zip(norm_ws, qkv_ws, qkv_bs):
            F.linear(compiled_norm(x, d, g)[1], w, b)

    def unfused_gate_up():
        for g, w in zip(norm_ws, gate_up_ws):
            silu_mul(F.linear(compiled_norm(x, d, g)[1], w))

    row = dict(shape=shape, rows=rows, unfused_qkv_us=graph_us_per_layer(unfused_qkv, layers),
               unfused_gate_up_us=graph_us_per_layer(unfused_gate_up, layers),
               cublas_qkv_us=graph_us_per_layer(lambda: [F.linear(x, w, b) for w, b in zip(qkv_ws, qkv_bs)], layers),
               cublas_gate_up_us=graph_us_per_layer(lambda: [F.linear(x, w) for w in gate_up_ws], layers))  # fmt: skip
    ref_h, ref_n = compiled_norm(x, d, norm_ws[0])
    ref_qkv, ref_act = F.linear(ref_n, qkv_ws[0], qkv_bs[0]), silu_mul(F.linear(ref_n, gate_up_ws[0]))
    for variant, scale_after in (("norm_first", False), ("scale_after", True)):
        for part, ws, bs, out, gated in (("qkv", qkv_ws, qkv_bs, qkv_out, False),
                                         ("gate_up", gate_up_ws, [None] * layers, act, True)):  # fmt: skip
            found = best_launch(every_layer(x, d, h, norm_ws, ws, bs, out, gated, scale_after), LAUNCHES, layers)
            norm_linear(x, d, h, norm_ws[0], ws[0], bs[0], out, gated, scale_after, found["launch"])
            ref = ref_qkv if part == "qkv" else ref_act
            found["maxdiff"] = float((out.float() - ref.float()).abs().max())
            found["ref_absmax"] = float(ref.float().abs().max())
            found["sum_equal"] = bool(torch.equal(h, ref_h))
            row[f"{variant}_{part}"] = found
        fused = row[f"{variant}_qkv"]["us_per_layer"] + row[f"{variant}_gate_up"]["us_per_layer"]
        row[f"{variant}_saved_us_per_layer"] = row["unfused_qkv_us"] + row["unfused_gate_up_us"] - fused
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for bench_norm_linear.json")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = p.parse_args()
    rows = measure_rows(measure, args.shapes, args.rows)
    info = card_info(rows=rows)
    write_json(args.out, "bench_norm_linear.json", info)


if __name__ == "__main__":
    main()
