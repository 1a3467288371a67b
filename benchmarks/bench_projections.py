"""The fused projection kernels (``sgl_piecewise/ops/kernels/projection.py``)
against cuBLAS and the unfused ops, at the projections of the suite's shapes
(a script, not a test).

    python benchmarks/bench_projections.py --out results/            # checks, the PDL chain
    python benchmarks/bench_projections.py --sweep --out results/    # candidate tilings: the card's table

Each time is a CUDA graph of many calls over rotating copies of the weights
(more bytes than the L2 holds, so every call reads its weight from memory,
as a model's layers do), median of replays ÷ calls. The chain row times a
decode layer's four projections back to back, with and without programmatic
dependent launch. Writes ``projections.json``; ``--sweep`` also times
every candidate tiling of each projection at 1 and 32 rows and writes the
fastest as the card's table, ``tilings_<card>.json`` (the library reads
``sgl_piecewise/ops/kernels/tilings/<card>.json``, or the file named by
``SGL_PIECEWISE_TILINGS``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from common import SHAPES, copy_rate, write_json  # noqa: E402 (benchmarks/ is the script's folder)

from sgl_piecewise.internals import pdl
from sgl_piecewise.ops.kernels import projection as P
from sgl_piecewise.ops.kernels.tilings import Tiling, default_tiling, rotary_kind, table_path, tiling_for

ROTATE_BYTES = 256 * 2**20  # weight copies per timing: past any L2


def projections(shape: str, tp: int = 1) -> dict:
    """name -> (kind, rows out, K) of one decoder layer's projections and the LM head, one rank's of ``tp``."""
    c = SHAPES[shape]
    h, f = c["hidden_size"], c["intermediate_size"] // tp
    hq, hkv = c["num_attention_heads"] // tp, max(1, c["num_key_value_heads"] // tp)
    d = c.get("head_dim", h // c["num_attention_heads"])
    out = {
        "qkv": ("qkv", (hq, hkv, d), h),
        "o": ("linear", h, hq * d),
        "gate_up": ("silu", f, h),
        "down": ("linear", h, f),
    }
    if tp == 1:
        out["lm_head"] = ("linear", c["vocab_size"], h)
    return out


def weight_rows(kind: str, n) -> int:
    if kind == "qkv":
        hq, hkv, d = n
        return (hq + 2 * hkv) * d
    return 2 * n if kind == "silu" else n


def table_kind_cols(kind: str, n) -> tuple:
    """The projection's kind and output columns as a tilings table names them (``tilings.py``)."""
    if kind == "qkv":
        hq, hkv, d = n
        return rotary_kind(d), (hq + 2 * hkv) * (d // 2)
    return kind, n


def kernel_tiling(kind: str, n, k: int, rows: int) -> Tiling:
    """The card's tiling of the projection, or the rule's where its table prefers cuBLAS (the kernel still runs)."""
    table_kind, cols = table_kind_cols(kind, n)
    device = torch.device("cuda", torch.cuda.current_device())
    return tiling_for(table_kind, rows, cols, k, device) or default_tiling(rows, cols, k, device)


def make_call(kind, n, k, rows, tiling, copies, x, positions, cos_sin, norm, residual):
    """A function of the copy index that runs one fused call (``tiling`` None: :func:`kernel_tiling`)."""
    tiling = tiling or kernel_tiling(kind, n, k, rows)
    if kind == "linear":
        return lambda i: P.linear(x, copies[i], residual=residual, tiling=tiling)
    if kind == "silu":
        return lambda i: P.gate_up_silu(x, copies[i], norm, 1e-6, tiling=tiling)
    hq, hkv, d = n
    return lambda i: P.qkv_rope(x, copies[i], None, positions, cos_sin, hq, hkv, d, norm, 1e-6, tiling=tiling)


def graph_time_us(call, num_copies: int, reps: int = 4) -> float:
    """Median µs a call, from a CUDA graph of ``num_copies * reps`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(num_copies):  # warm (compiles)
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for i in range(num_copies):
                call(i)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (num_copies * reps))
    return statistics.median(times)


def candidates(rows: int) -> list:
    """The tilings a sweep times: at one row, CUDA-core and tensor-core ones."""
    dot = [(16, 256, 1), (16, 512, 1), (16, 256, 2), (32, 256, 1), (16, 128, 4), (64, 128, 1)]
    if rows > 1:
        dot = [(16, 128, 1), (16, 256, 1), (32, 128, 1), (16, 128, 2), (32, 64, 2), (64, 64, 1)]
    out = [Tiling(block_n=bn, block_k=bk, split_k=sk) for bn, bk, sk in dot]
    if rows == 1:
        for bn, bk, sk in ((8, 512, 1), (16, 256, 1), (8, 256, 2), (4, 512, 1), (32, 128, 1), (8, 512, 4)):
            out.append(Tiling(block_n=bn, block_k=bk, split_k=sk, fma=True))
        # Whole rows of a small K in one chunk: every weight load in flight before the PDL wait.
        for bn, bk, warps in ((1, 2048, 4), (2, 1024, 4), (2, 2048, 4), (4, 1024, 4), (4, 2048, 8), (1, 8192, 8)):
            out.append(Tiling(block_n=bn, block_k=bk, num_warps=warps, fma=True))
    return out


def table_key(kind, n, k) -> str:
    """The projection's key in a tilings table (``tilings.py``)."""
    table_kind, cols = table_kind_cols(kind, n)
    return f"{table_kind}:{cols}:{k}"


def inputs(kind, n, k, rows, dtype=torch.bfloat16):
    dev = "cuda"
    size = weight_rows(kind, n) * k * 2
    num_copies = max(2, min(64, ROTATE_BYTES // size))
    copies = [torch.randn(weight_rows(kind, n), k, device=dev).to(dtype) / k**0.5 for _ in range(num_copies)]
    x = torch.randn(rows, k, device=dev).to(dtype)
    norm = (1 + 0.1 * torch.randn(k, device=dev)).to(dtype)
    out_cols = n if kind != "qkv" else None
    residual = torch.randn(rows, out_cols, device=dev).to(dtype) if kind == "linear" else None
    positions = torch.randint(0, 4096, (rows,), device=dev)
    d = n[2] if kind == "qkv" else 2
    cos_sin = torch.randn(4096, d, device=dev).to(dtype)
    return copies, x, positions, cos_sin, norm, residual


def reference_call(kind, n, copies, x, positions, cos_sin, norm, residual):
    """The unfused ops the fused kernel replaces: cuBLAS for the product."""
    from sgl_piecewise.ops.kernels import elementwise

    if kind == "linear":
        return lambda i: torch.add(residual, F.linear(x, copies[i]))
    if kind == "silu":
        return lambda i: elementwise.silu_mul(F.linear(elementwise.rms_norm(x, norm, 1e-6), copies[i]))
    hq, hkv, d = n

    def qkv(i):
        out = F.linear(elementwise.rms_norm(x, norm, 1e-6), copies[i])
        qk = out[:, : (hq + hkv) * d].view(-1, hq + hkv, d)
        return elementwise.rotary(positions, qk, cos_sin)

    return qkv


def check(kind, n, k, rows) -> float:
    """Relative error of the fused call against float64 (one copy, default tiling)."""
    copies, x, positions, cos_sin, norm, residual = inputs(kind, n, k, rows)
    w = copies[0]
    got = make_call(kind, n, k, rows, None, copies, x, positions, cos_sin, norm, residual)(0)
    xd = x.double()
    if kind == "linear":
        want = residual.double() + xd @ w.double().T
        got_t = got
    else:
        xn = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.double()
        y = xn @ w.double().T
        if kind == "silu":
            g, u = y.chunk(2, -1)
            want, got_t = F.silu(g) * u, got
        else:
            hq, hkv, d = n
            qk = y[:, : (hq + hkv) * d].view(-1, hq + hkv, d)
            cos, sin = cos_sin.double()[positions].chunk(2, -1)
            x1, x2 = qk.chunk(2, -1)
            want = torch.cat((x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]), -1)
            got_t = got[0]
    return ((got_t.double() - want).norm() / want.norm()).item()


def sweep(args, info: dict) -> dict:
    """Time every candidate tiling; the fastest of each projection and row
    count, in a tilings table (written after each projection)."""
    results, table = [], {}
    card = torch.cuda.get_device_name()
    path = os.path.join(args.out, table_path(card).name)
    for shape, tp in args.shapes:
        for name, (kind, n, k) in projections(shape, tp).items():
            for rows in args.rows:
                copies, x, positions, cos_sin, norm, residual = inputs(kind, n, k, rows)
                row = dict(shape=shape, tp=tp, proj=name, rows=rows, bytes=copies[0].numel() * 2, tilings=[])
                row["cublas_us"] = graph_time_us(
                    reference_call(kind, n, copies, x, positions, cos_sin, norm, residual), len(copies)
                )
                calls = {t: make_call(kind, n, k, rows, t, copies, x, positions, cos_sin, norm, residual)
                         for t in candidates(rows)}  # fmt: skip
                precompile(calls)
                for tiling, call in calls.items():
                    try:
                        row["tilings"].append((tiling.__dict__, graph_time_us(call, len(copies))))
                    except Exception as exc:  # a tiling that does not compile (registers, shared memory)
                        row.setdefault("failed", []).append(f"{tiling}: {type(exc).__name__}: {exc}"[:300])
                best = min(row["tilings"], key=lambda t: t[1])
                row["best"] = best
                table.setdefault(table_key(kind, n, k), {})["1" if rows == 1 else "many"] = best[0]
                results.append(row)
                rate = row["bytes"] / best[1] / 1e6
                print(f"{shape} tp{tp} {name:8s} rows {rows:3d}: cublas+ops {row['cublas_us']:7.2f} us, "
                      f"best {best[1]:7.2f} {best[0]} ({rate:.2f} TB/s)", flush=True)  # fmt: skip
                del copies, calls
                with open(path, "w") as f:
                    json.dump({"card": card, "torch": info["torch"], "triton": info["triton"], "tilings": table},
                              f, indent=1, sort_keys=True)  # fmt: skip
                write_json(args.out, "projections_sweep.json", dict(info, sweep=results))
    return {"sweep": results, "table": path}


def precompile(calls: dict) -> None:
    """One call of each on its own thread: Triton compiles outside the GIL."""

    def first(call):
        try:
            call(0)
        except Exception:  # timed (and recorded) later
            pass

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(first, calls.values()))
    torch.cuda.synchronize()


def chain(shape: str, rows: int, layers: int = 16) -> dict:
    """A decode layer's projections ``layers`` times in one graph (distinct
    weights), with and without PDL: µs a layer; and each projection alone
    (µs, share of the copy rate)."""
    out = {}
    projs = projections(shape)
    per_layer, alone = [], {}
    for name in ("qkv", "o", "gate_up", "down"):
        kind, n, k = projs[name]
        copies, x, positions, cos_sin, norm, residual = inputs(kind, n, k, rows)
        copies = [torch.randn_like(copies[0]) for _ in range(layers)]
        per_layer.append(make_call(kind, n, k, rows, None, copies, x, positions, cos_sin, norm, residual))
        alone[name] = (per_layer[-1], copies[0].numel() * copies[0].element_size())
    for flag in ("1", "0"):
        os.environ[pdl.ENV_SWITCH] = flag
        out["pdl" if flag == "1" else "no_pdl"] = graph_time_us(lambda i: [c(i) for c in per_layer], layers, 2)
    os.environ.pop(pdl.ENV_SWITCH)
    rate = copy_rate()
    for name, (call, size) in alone.items():
        us = graph_time_us(call, layers)
        out[f"{name}_alone"] = {"us": us, "share_of_copy_rate": size / (us * 1e-6) / rate}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    p.add_argument("--shapes", nargs="+", default=["0.5b", "1b", "135m", "8b/2"],
                   help="SHAPE or SHAPE/TP (one rank's shard)")  # fmt: skip
    args = p.parse_args()
    args.shapes = [(s.split("/")[0], int(s.split("/")[1]) if "/" in s else 1) for s in args.shapes]
    info = dict(card=torch.cuda.get_device_name(), torch=torch.__version__, argv=sys.argv,
                date=time.strftime("%Y-%m-%d", time.gmtime()), pdl=pdl.AVAILABLE,
                pdl_reason=pdl.UNAVAILABLE_REASON, copy_rate_Bps=copy_rate())  # fmt: skip
    import triton

    info["triton"] = triton.__version__
    print(json.dumps(info), flush=True)
    info["checks"] = {}
    for shape, tp in args.shapes:
        for name, (kind, n, k) in projections(shape, tp).items():
            for rows in args.rows:
                try:
                    err = check(kind, n, k, rows)
                except Exception as exc:  # recorded; the other rows still run
                    err = f"{type(exc).__name__}: {exc}"[:2000]
                info["checks"][f"{shape}/{tp} {name} {rows}"] = err
                print(f"check {shape}/{tp} {name} rows {rows}: rel err {err}", flush=True)
    for shape in sorted({s for s, tp in args.shapes if tp == 1}):
        for rows in args.rows:
            try:
                c = chain(shape, rows)
            except Exception as exc:
                c = f"{type(exc).__name__}: {exc}"[:2000]
            info[f"chain_{shape}_{rows}"] = c
            print(f"chain {shape} rows {rows}: {c}", flush=True)
    if args.sweep:
        info.update(sweep(args, info))
        os.environ["SGL_PIECEWISE_TILINGS"] = info["table"]
        for shape in sorted({s for s, tp in args.shapes if tp == 1}):
            for rows in args.rows:
                info[f"chain_tuned_{shape}_{rows}"] = c = chain(shape, rows)
                print(f"chain (tuned tilings) {shape} rows {rows}: {c}", flush=True)
    path = write_json(args.out, "projections_sweep.json" if args.sweep else "projections.json", info)
    print("wrote", path)


if __name__ == "__main__":
    main()
