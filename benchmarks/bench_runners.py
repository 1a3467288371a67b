"""The graph runners side by side (a script, not a test): one ``ModelRunner``
per graph policy — ``none`` (eager), ``full`` (whole-model graphs of the
eager model), ``piecewise``, ``breakable``, ``auto`` (whole-model graphs of
the compiled model for decode, pieces for prefill) — timed through
``forward_step`` (validation, dispatch and logits included) on the same
shapes: decode at batch 1, 8, 32 and 128 with ``--context`` tokens cached,
and EXTEND of 16, 128 and 512 new tokens. Exactly these sizes are captured,
so no step pays for padding, and each timed step's path is recorded: an
entry never silently measures a fallback.

    python benchmarks/bench_runners.py --out results/                 # GPU: Qwen2-0.5B-shaped, bf16
    python benchmarks/bench_runners.py --device cpu --tiny --out r/  # CPU smoke test of the logic

Writes ``runners.json`` and prints it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
from common import QWEN_05B  # noqa: E402 (benchmarks/ is the script's folder)

import sgl_piecewise as sp
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.engine.testing import place_requests, release_batch
from sgl_piecewise.models import ModelConfig, build_random_model

TINY = dict(
    architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=101, max_position_embeddings=128,
)  # fmt: skip
POLICIES = ("none", "full", "piecewise", "breakable", "auto")
DECODE_BS, EXTEND_TOKENS = (1, 8, 32, 128), (16, 128, 512)
TINY_DECODE_BS, TINY_EXTEND_TOKENS = (1, 2, 4), (4, 8, 16)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default=None, help="default: triton on cuda, torch on the cpu")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--context", type=int, default=1024, help="tokens cached per decode request")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--piece-compiler", default=None, help="default: inductor on cuda, eager with --tiny")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model and small shapes (smoke test)")
    args = p.parse_args(argv)
    args.policies = [g for g in args.policies.split(",") if g]
    if args.tiny:
        args.decode_bs, args.extend, args.context = TINY_DECODE_BS, TINY_EXTEND_TOKENS, min(args.context, 32)
        args.iters, args.warmup = min(args.iters, 3), min(args.warmup, 1)
    else:
        args.decode_bs, args.extend = DECODE_BS, EXTEND_TOKENS
    args.backend = args.backend or ("triton" if args.device == "cuda" else "torch")
    args.piece_compiler = args.piece_compiler or ("eager" if args.tiny else "inductor")
    return args


def build_model(args):
    config = ModelConfig.from_hf_dict(TINY if args.tiny else QWEN_05B)
    return build_random_model(config, build_dtype(args), args.device, seed=0, std=0.2 if args.tiny else 0.02)


def build_runner(model, args, policy: str) -> ModelRunner:
    longest = max(args.context + 1, max(args.extend))
    slots = max(args.decode_bs) * (args.context + 1) + max(args.extend) + 64
    runner = ModelRunner(model, max_reqs=max(args.decode_bs) + 1, max_context_len=longest, num_slots=slots,
                         backend=args.backend, graphs=policy)  # fmt: skip
    for layer in range(model.config.num_hidden_layers):  # stand-in cache contents: random, not zeros
        runner.kv_pool.k_buffers[layer].normal_()
        runner.kv_pool.v_buffers[layer].normal_()
    return runner


def shapes(args):
    """``(name, mode, prefix_lens, extend_lens)`` of every timed step."""
    for bs in args.decode_bs:
        yield f"decode bs {bs}", sp.ForwardMode.DECODE, [args.context] * bs, [1] * bs
    for n in args.extend:
        yield f"extend {n}", sp.ForwardMode.EXTEND, [0], [n]


def median_step_ms(runner: ModelRunner, batch, args) -> float:
    """Wall time of ``forward_step`` (it synchronises the device before returning)."""
    for _ in range(args.warmup):
        runner.forward_step(batch)
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        runner.forward_step(batch)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure_policy(model, args, policy: str) -> dict:
    torch._dynamo.reset()  # each policy compiles (or not) from scratch
    runner = build_runner(model, args, policy)
    reserved = torch.cuda.memory_reserved() if args.device == "cuda" else 0
    sizes = sorted({*args.decode_bs, *args.extend})
    report = runner.capture_graphs(progress=False, capture_bs=args.decode_bs, capture_sizes=sizes,
                                   piece_compiler=args.piece_compiler)  # fmt: skip
    result = {"capture_s": report.seconds, "captured": report.paths, "steps": {}}
    if args.device == "cuda":
        result["capture_reserved_gib"] = (torch.cuda.memory_reserved() - reserved) / 2**30
    for name, mode, prefix, extend in shapes(args):
        rows, loc = place_requests(runner.req_to_token_pool, runner.kv_pool, prefix, extend, fill_prefix=False)
        ids = torch.randint(0, model.config.vocab_size, (sum(extend),), device=args.device)
        batch = sp.ForwardBatch.build(mode, ids, rows, prefix, extend, loc)
        try:
            ms = median_step_ms(runner, batch, args)
            result["steps"][name] = {"ms": ms, "path": runner.step_stats[-1].path}
        finally:
            release_batch(runner.req_to_token_pool, runner.kv_pool, batch)
    del runner
    gc.collect()
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    model = build_model(args)
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "backend": args.backend, "piece_compiler": args.piece_compiler,
        "model": "tiny" if args.tiny else "Qwen2-0.5B-shaped, random weights", "dtype": str(build_dtype(args)),
        "context": args.context, "argv": sys.argv[1:] if argv is None else list(argv),
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "policies": {},
    }  # fmt: skip
    for policy in args.policies:
        print(f"graphs={policy} ...", file=sys.stderr)
        result["policies"][policy] = measure_policy(model, args, policy)
    print(json.dumps(result, indent=1))
    with open(os.path.join(args.out, "runners.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def build_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.device == "cuda" else torch.float32


if __name__ == "__main__":
    main()
