"""Step-time benchmark (a script, not a test): eager vs ``sgl_piecewise``
without graphs vs with piecewise graphs vs whole-model decode graphs
(``CudaGraphRunner``, decode only) vs ``torch.compile(mode=
"reduce-overhead")`` vs Hugging Face eager, as multiples of the floor (docs/BENCHMARKS.md).

    python benchmarks/bench_steps.py --out results/          # full run
    python benchmarks/bench_steps.py --startup-only --out r/  # warm start (2nd process)

Decode at batch 1, 8, 32, 128 with 1024 tokens of context; EXTEND of 1, 16,
128, 512, 2048 tokens; cold start (compile + capture of the default sizes up
to 512) and graph pool memory. Writes ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch._dynamo
from common import (  # noqa: E402 (benchmarks/ is the script's folder)
    QWEN_05B,
    copy_rate,
    cuda_median_ms,
    free_batch,
    graph_step_fn,
    make_batch,
    matmul_rate,
    step_fn,
    time_paths,
    weight_bytes,
)

import sgl_piecewise as sp
from sgl_piecewise.backends.factory import create_backend
from sgl_piecewise.compile import CompiledModel, CompileOptions, counters
from sgl_piecewise.models import ModelConfig, build_random_model
from sgl_piecewise.runner import ModelRunner
from sgl_piecewise.runners.piecewise import PiecewiseCudaGraphRunner
from sgl_piecewise.runners.whole_model import CudaGraphRunner


def build(args):
    config = ModelConfig.from_hf_dict(QWEN_05B)
    model = build_random_model(config, torch.bfloat16, "cuda", seed=0)
    max_reqs = max(args.decode_bs)
    slots = max_reqs * args.context + max(args.extend) + 1024

    def backend(table, pool):
        return create_backend(args.backend, table, pool, num_q_heads=config.num_attention_heads)

    runner = ModelRunner(model, max_reqs=max_reqs + 2, max_context_len=max(args.context, max(args.extend)) + 8,
                         num_slots=slots, backend=backend)  # fmt: skip
    for layer in range(config.num_hidden_layers):  # stand-in cache contents: random, not zeros
        runner.kv_pool.k_buffers[layer].normal_()
        runner.kv_pool.v_buffers[layer].normal_()
    return model, runner


def cold_start(runner, max_size):
    torch.cuda.synchronize()
    mem0, alloc0 = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    start = time.perf_counter()
    graphs = PiecewiseCudaGraphRunner(runner, CompileOptions(cudagraphs=True, max_capture_size=max_size))
    graphs.capture(progress=True)
    seconds = time.perf_counter() - start
    return graphs.compiled, {
        "cold_start_s": seconds,
        "first_size_s (trace + compile + capture)": graphs.first_size_seconds,
        "sizes": len(graphs.options.capture_sizes),
        "reserved_delta_gib": (torch.cuda.memory_reserved() - mem0) / 2**30,
        "allocated_delta_gib": (torch.cuda.memory_allocated() - alloc0) / 2**30,
        "counters": counters.as_dict(),
    }


def decode_graphs_start(runner):
    """Capture the whole-model decode graphs (SGLang's schedule up to the
    request table) of the sgl_piecewise-compiled model (Inductor pieces,
    attention inside the graph); return (capture time and memory, the runner)."""
    torch.cuda.synchronize()
    mem0 = torch.cuda.memory_reserved()
    graphs = CudaGraphRunner(runner, forward=CompiledModel(runner.model, CompileOptions()))
    seconds = graphs.capture(progress=True)
    return {"capture_s": seconds, "sizes": len(graphs.capture_bs), "max_bs": graphs.max_bs,
            "reserved_delta_gib": (torch.cuda.memory_reserved() - mem0) / 2**30}, graphs  # fmt: skip


def hf_decode_ms(args, bs):
    import transformers

    cfg = {k: v for k, v in QWEN_05B.items() if k != "architectures"}
    with torch.device("cuda"):
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg)).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg["vocab_size"], (bs, args.context - 1), device="cuda")
    with torch.no_grad():
        out = hf(input_ids=ids, use_cache=True)
        cache = out.past_key_values
        nxt = torch.randint(0, cfg["vocab_size"], (bs, 1), device="cuda")

        def step():
            hf(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # drop the token just added (negative: the same in transformers 4 and 5)

        ms = cuda_median_ms(step, 3, 20)
    hf = cache = None  # drop the model and its cache before freeing the memory
    torch.cuda.empty_cache()
    return ms


def time_modes(runner, modes, batch, decode_graphs=None):
    """``modes``: name -> model callable, each timed as a whole step; with
    ``decode_graphs``, also the step replayed by ``CudaGraphRunner``."""
    steps = {name: (lambda fn=fn, name=name: step_fn(runner, fn, batch, keep_metadata=name == "reduce_overhead"))
             for name, fn in modes.items()}  # fmt: skip
    if decode_graphs is not None:
        steps["decode_graphs"] = lambda: graph_step_fn(runner, decode_graphs, batch)
    if "reduce_overhead" in steps:  # last: the only mode whose graph reads another step's tensors
        steps["reduce_overhead"] = steps.pop("reduce_overhead")
    return time_paths(steps)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--backend", default="triton")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--extend", type=int, nargs="+", default=[1, 16, 128, 512, 2048])
    p.add_argument("--reduce-overhead-extend", type=int, nargs="*", default=[16, 512])
    p.add_argument("--max-capture-size", type=int, default=512)
    p.add_argument("--startup-only", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args()
    # One code object is compiled once per variant here (graphs, no graphs,
    # reduce-overhead per shape): more than Dynamo's default limit of 8.
    torch._dynamo.config.cache_size_limit = 64
    os.makedirs(args.out, exist_ok=True)
    info = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "backend": args.backend,
            "argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    model, runner = build(args)
    graphs, start = cold_start(runner, args.max_capture_size)
    info["startup"] = start
    print(json.dumps(start, indent=1))
    if args.startup_only:
        json.dump(info, open(os.path.join(args.out, "startup.json"), "w"), indent=1)
        return
    info["decode_graphs"], decode_graphs = decode_graphs_start(runner)
    print(json.dumps(info["decode_graphs"]), flush=True)
    info["copy_rate_Bps"], info["matmul_flops"] = copy_rate(), matmul_rate()
    read_bytes, nonemb_params = weight_bytes(model)
    compiled = CompiledModel(model, CompileOptions())
    cfg = model.config
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    info["decode"], info["extend"] = {}, {}
    with torch.no_grad():
        for bs in args.decode_bs:
            batch = make_batch(runner, sp.ForwardMode.DECODE, [args.context - 1] * bs, [1] * bs)
            reduce_overhead = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)
            modes = {"eager": model, "sgl_piecewise": compiled, "piecewise_graphs": graphs,
                     "reduce_overhead": reduce_overhead}  # fmt: skip
            r = time_modes(runner, modes, batch, decode_graphs)
            r["floor_ms"] = 1e3 * (read_bytes + bs * args.context * kv_per_token) / info["copy_rate_Bps"]
            if not args.skip_hf:
                r["hf_eager"] = hf_decode_ms(args, bs)
            info["decode"][bs] = r
            print("decode", bs, json.dumps(r), flush=True)
            free_batch(runner, batch)
        for n in args.extend:
            batch = make_batch(runner, sp.ForwardMode.EXTEND, [0], [n])
            modes = {"eager": model, "sgl_piecewise": compiled, "piecewise_graphs": graphs}
            if n in args.reduce_overhead_extend:
                modes["reduce_overhead"] = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)
            r = time_modes(runner, modes, batch)
            r["floor_ms"] = 1e3 * max(read_bytes / info["copy_rate_Bps"], 2 * nonemb_params * n / info["matmul_flops"])
            info["extend"][n] = r
            print("extend", n, json.dumps(r), flush=True)
            free_batch(runner, batch)
    info["counters_end"] = counters.as_dict()
    json.dump(info, open(os.path.join(args.out, "results.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
