"""The LM head at decode batch sizes: float32 logits two ways, against the
weight read's floor (a script, not a test).

For the suite's two vocabularies (0.5b: 896 -> 151,936, tied to the
embedding; 1b: 2048 -> 128,256) and 1 / 8 / 32 rows, µs per call, each
call one of four in a CUDA graph that alternates two copies of the weight
(each larger than L2), median of CUDA-event timings of the graph:

* ``linear_bf16``: ``F.linear`` alone, bf16 logits (cuBLAS);
* ``linear_then_float``: ``F.linear(...).float()``, the LM head before
  ``layers.float32_logits``;
* ``mm_out_float32``: ``torch.mm(..., out_dtype=torch.float32)``, what
  ``layers.float32_logits`` runs on CUDA;
* ``triton_best`` (with ``--triton``): ``bench_skinny_gemm.py``'s kernel
  writing float32, best of a sweep of its launch settings;
* ``floor``: the weight's bytes at the card's copy rate.

    python benchmarks/bench_lm_head.py --out results/ [--triton]
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F
import triton
from bench_skinny_gemm import triton_linear  # noqa: E402 (benchmarks/ is the script's folder)
from common import copy_rate, median_ms, write_json  # noqa: E402

from sgl_piecewise.models.layers import float32_logits

VOCABULARIES = {"0.5b": (896, 151936), "1b": (2048, 128256)}  # name: (hidden, vocab)
CALLS_PER_GRAPH = 4


def graph_us(call) -> float:
    """µs per ``call(i)`` (``i`` picks the weight copy), four in a graph."""
    call(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            call(i % 2)
    return 1e3 * median_ms(graph.replay, 5, 30) / CALLS_PER_GRAPH


def triton_best(x, weights, out) -> dict:
    best = None
    for config in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (2, 3, 4)):
        try:
            us = graph_us(lambda i, c=config: triton_linear(x, weights[i], None, out, *c))
        except Exception:  # out of shared memory or registers: not a candidate
            continue
        if best is None or us < best[0]:
            best = (us, config)
    return {"triton_best": best[0], "triton_config": best[1]}


def row(hidden_size: int, vocab: int, rows: int, rate: float, sweep: bool) -> dict:
    weights = [torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16) / hidden_size**0.5
               for _ in range(2)]  # fmt: skip
    x = torch.randn(rows, hidden_size, device="cuda", dtype=torch.bfloat16)
    result = {
        "linear_bf16": graph_us(lambda i: F.linear(x, weights[i])),
        "linear_then_float": graph_us(lambda i: F.linear(x, weights[i]).float()),
        "mm_out_float32": graph_us(lambda i: float32_logits(x, weights[i])),
        "floor": 1e6 * vocab * hidden_size * 2 / rate,
    }
    if sweep:
        result.update(triton_best(x, weights, torch.empty(rows, vocab, device="cuda", dtype=torch.float32)))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--triton", action="store_true", help="also sweep the Triton kernel's launch settings")
    args = p.parse_args()
    rate = copy_rate()
    result = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "copy_rate_Bps": rate, "us": {}}  # fmt: skip
    for name, (hidden_size, vocab) in VOCABULARIES.items():
        for rows in args.rows:
            r = row(hidden_size, vocab, rows, rate, args.triton)
            result["us"][f"{name} rows={rows}"] = r
            print(name, rows, {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    print("wrote", write_json(args.out, "lm_head.json", result))


if __name__ == "__main__":
    main()
