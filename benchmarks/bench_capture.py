"""Capture time and memory of the graph runners (a script, not a test).

Qwen2.5-0.5B shape, bf16, random weights. In one process, both through the
shared capture core (one pool, one capture stream):

1. piecewise graphs (``PiecewiseCudaGraphRunner``) of the default token
   counts (52 sizes up to 512), Inductor pieces;
2. whole-model decode graphs (``CudaGraphRunner``) of SGLang's batch sizes up
   to 128 (20 sizes), recording the Inductor-compiled model.

For each: wall time, the number of sizes, and the growth of the memory the
caching allocator reserved (``torch.cuda.memory_reserved``) and of the
memory allocated, across the capture (warm-ups included), and the growth of
the graph pool's own segments (from ``torch.cuda.memory._snapshot``).

    python benchmarks/bench_capture.py --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from common import QWEN_05B  # noqa: E402 (benchmarks/ is the script's folder)

from sgl_piecewise.compile import CompiledModel, CompileOptions
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.graphs.capture import shared_capture
from sgl_piecewise.models import ModelConfig, build_random_model
from sgl_piecewise.runners import CudaGraphRunner, PiecewiseCudaGraphRunner
from sgl_piecewise.runners.whole_model import default_capture_sizes


def measured(capture) -> dict:
    """Run ``capture()`` (returns its seconds); memory growth around it, and
    how much of the reserved growth is the graph pool's."""
    torch.cuda.synchronize()
    core = shared_capture("cuda")
    reserved, allocated, pool = torch.cuda.memory_reserved(), torch.cuda.memory_allocated(), core.pool_bytes()
    seconds = capture()
    torch.cuda.synchronize()
    return {
        "seconds": seconds,
        "reserved_delta_gib": (torch.cuda.memory_reserved() - reserved) / 2**30,
        "allocated_delta_gib": (torch.cuda.memory_allocated() - allocated) / 2**30,
        "pool_delta_gib": (core.pool_bytes() - pool) / 2**30,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--backend", default="triton")
    p.add_argument("--max-decode-bs", type=int, default=128)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    config = ModelConfig.from_hf_dict(QWEN_05B)
    model = build_random_model(config, torch.bfloat16, "cuda", seed=0)
    runner = ModelRunner(model, max_reqs=args.max_decode_bs, max_context_len=1024, kv_cache_gib=4.0,
                         backend=args.backend)  # fmt: skip
    result = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "backend": args.backend,
              "argv": sys.argv, "date": time.strftime("%Y-%m-%d", time.gmtime())}  # fmt: skip
    piecewise = PiecewiseCudaGraphRunner(runner, CompileOptions(cudagraphs=True))
    result["piecewise"] = {"sizes": len(piecewise.options.capture_sizes), **measured(piecewise.capture)}
    result["piecewise"]["first_size_seconds"] = piecewise.first_size_seconds
    sizes = default_capture_sizes(args.max_decode_bs)
    decode = CudaGraphRunner(runner, sizes, forward=CompiledModel(model))
    result["whole_model_decode"] = {"sizes": len(sizes), **measured(decode.capture)}
    print(json.dumps(result, indent=1))
    json.dump(result, open(os.path.join(args.out, "capture.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
