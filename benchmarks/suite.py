"""The benchmark suite (a script, not a test): every path of the library on
one card, side by side in one process per model shape.

    python benchmarks/suite.py run --shape 0.5b --out results/
    python benchmarks/suite.py run --shape 0.5b --startup-only --out results/  # warm start: a 2nd process
    # --cache-dir DIR on both runs: the 2nd process starts from the 1st's compile artifacts
    python benchmarks/suite.py run --shape 1b --out results/
    python benchmarks/suite.py report results/ --out results/   # markdown tables and PNG plot (matplotlib)
    python benchmarks/suite.py run --shape tiny --device cpu --out /tmp/smoke  # the logic, on a CPU

One ``run`` builds the shape with random bf16 weights and the ``triton``
backend (``--backend``; ``torch`` on a CPU) and measures, in this order:

* start-up: compile and capture of the piecewise graphs of the default 52
  token counts (cold when the Inductor cache is empty; ``--startup-only`` in
  a second process measures the warm start) and the memory the capture adds;
* whole-model decode graphs of SGLang's batch sizes up to the largest
  decode batch, recording the model compiled whole (attention inside one
  Inductor graph) and, for comparison, compiled in pieces; capture time and
  memory of each;
* decode at ``--decode-bs`` with ``--context`` tokens per request and
  extend of ``--extend`` tokens (one request, no prefix), each path a whole
  step (metadata, model, LM head on each request's last token), median of
  CUDA-event timings taken in interleaved rounds (``common.time_paths``):
  ``eager``, ``hf_eager`` (``transformers``, same shape, timed on its own),
  ``reduce_overhead`` (``torch.compile(mode="reduce-overhead")`` of our
  model: it replays the captured batch's attention metadata, a timing
  reference only; compiled for each row in a fresh Dynamo state, which the
  other paths, called without Dynamo after their capture, do not need),
  ``piecewise``, ``whole_model``, ``whole_model_pieces``, and the ``floor``
  (docs/BENCHMARKS.md defines it);
* where the time goes: CUDA kernels per layer in one whole-model replay
  (torch.profiler, after every timing: a profiler slows the launches that
  follow it in the process).

Writes ``suite_<shape>.json`` (``startup_<shape>.json`` with
``--startup-only``). A failing path is recorded with its error and the rest
still run. Start-ups assume Python's bytecode is cached, as in an installed
package: with ``PYTHONDONTWRITEBYTECODE`` set over packages installed
without it, each process compiles the sources of the modules it imports
(the JSON's ``bytecode_written`` records the setting; a warning is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from typing import Callable, Dict

import torch
import torch._dynamo
from common import (  # noqa: E402 (benchmarks/ is the script's folder)
    SHAPES,
    copy_rate,
    decode_floor_ms,
    extend_floor_ms,
    free_batch,
    graph_step_fn,
    kv_bytes_per_token,
    make_batch,
    matmul_rate,
    median_ms,
    step_fn,
    time_paths,
    weight_bytes,
)
from suite_profile import replay_profile  # noqa: E402

import sgl_piecewise as sp
from sgl_piecewise.compile import CompiledModel, CompileOptions, counters
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.models import ModelConfig, build_random_model, set_fused_projections
from sgl_piecewise.runners import CudaGraphRunner, PiecewiseCudaGraphRunner
from sgl_piecewise.runners.whole_model import default_capture_sizes


def build(args):
    config = ModelConfig.from_hf_dict(SHAPES[args.shape])
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_random_model(config, dtype, args.device, seed=0)
    set_fused_projections(model, args.fused_projections)
    max_reqs = max(args.decode_bs) + 2
    # Room for the longest step, and for the piecewise capture's dummy step
    # of the largest default size (512 tokens).
    context = max(args.context, max(args.extend), 512) + 8
    runner = ModelRunner(model, max_reqs=max_reqs, max_context_len=context,
                         num_slots=max_reqs * context + max(args.extend), backend=args.backend)  # fmt: skip
    for layer in range(config.num_hidden_layers):  # stand-in cache contents: random, not zeros
        runner.kv_pool.k_buffers[layer].normal_()
        runner.kv_pool.v_buffers[layer].normal_()
    return model, runner


def memory_reserved() -> int:
    return torch.cuda.memory_reserved() if torch.cuda.is_available() else 0


def timed_capture(capture: Callable[[], float]) -> dict:
    """Run a capture (returns its seconds); the memory it reserved."""
    before = memory_reserved()
    seconds = capture()
    return {"seconds": seconds, "reserved_delta_gib": (memory_reserved() - before) / 2**30}


def start_up(runner, cache_dir=None) -> tuple:
    """Compile and capture the piecewise graphs; ``cache_dir``: start from
    (and save) compile artifacts there (``CompileOptions.cache_dir``)."""
    piecewise = PiecewiseCudaGraphRunner(runner, CompileOptions(cudagraphs=True, cache_dir=cache_dir))
    result = timed_capture(lambda: piecewise.capture(progress=False))
    result.update(first_size_seconds=piecewise.first_size_seconds, sizes=len(piecewise.options.capture_sizes),
                  compiles_loaded=counters.compiles_loaded, compiles_saved=counters.compiles_saved,
                  artifacts_loaded=counters.artifacts_loaded, artifacts_saved=counters.artifacts_saved)  # fmt: skip
    return piecewise, result


def whole_model_runners(runner, max_bs: int) -> tuple:
    """Whole-model graphs recording the model compiled whole, and in pieces,
    captured but not installed: each path is timed through its own runner."""
    sizes = default_capture_sizes(max_bs)
    runners, info = {}, {}
    for name, split in (("whole_model", False), ("whole_model_pieces", True)):
        graphs = CudaGraphRunner(runner, sizes, forward=CompiledModel(runner.model, CompileOptions(split_graph=split)))
        info[name] = {"sizes": len(sizes), **timed_capture(lambda g=graphs: g.capture(progress=False))}
        runners[name] = graphs
    return runners, info


def hf_model(args):
    import transformers

    cfg = {k: v for k, v in SHAPES[args.shape].items() if k != "architectures"}
    arch = SHAPES[args.shape]["architectures"][0]
    config_cls = transformers.Qwen2Config if arch.startswith("Qwen2") else transformers.LlamaConfig
    with torch.device(args.device):
        return getattr(transformers, arch)(config_cls(**cfg)).to(torch.bfloat16).eval()


def hf_decode_ms(hf, args, bs: int) -> float:
    """One decode step of ``transformers`` over a DynamicCache of ``context`` tokens."""
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (bs, args.context - 1), device=args.device)
    with torch.no_grad():
        cache = hf(input_ids=ids, use_cache=True).past_key_values
        nxt = torch.randint(0, vocab, (bs, 1), device=args.device)

        def step():
            hf(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # drop the token just added (negative: the same in transformers 4 and 5)

        return median_ms(step, 3, 20)


def step_paths(runner, batch, piecewise, whole: dict, reduce_overhead: bool) -> Dict[str, Callable]:
    """Factories of one whole step of ``batch`` through each path; with
    ``reduce_overhead``, the model compiled so for this batch, from a fresh
    Dynamo state (``torch._dynamo.reset`` also drops torch's CUDA-graph
    trees: their graphs record attention with the recording step's metadata
    and slots, which another batch's steps must never replay)."""
    model = runner.model
    paths = {"eager": lambda: step_fn(runner, model, batch), "piecewise": lambda: step_fn(runner, piecewise, batch)}
    for name, graphs in whole.items():
        paths[name] = lambda g=graphs: graph_step_fn(runner, g, batch)
    if reduce_overhead:
        torch._dynamo.reset()
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)
        # Every step's metadata kept alive: see step_fn.
        paths["reduce_overhead"] = partial(step_fn, runner, compiled, batch, keep_metadata=True)
    return paths


def step_batch(args, runner, kind: str, size: int):
    """The timed step: ``decode`` of ``size`` requests with ``--context``
    tokens each (the new one included), or ``extend`` of ``size`` new tokens
    of one request with no prefix."""
    if kind == "decode":
        return make_batch(runner, sp.ForwardMode.DECODE, [args.context - 1] * size, [1] * size)
    return make_batch(runner, sp.ForwardMode.EXTEND, [0], [size])


def decode_rows(args, model, runner, piecewise, whole, ceilings, hf) -> dict:
    rows = {}
    read_bytes, _ = weight_bytes(model)
    for bs in args.decode_bs:
        batch = step_batch(args, runner, "decode", bs)
        row = time_paths(step_paths(runner, batch, piecewise, whole, not args.skip_reduce_overhead))
        if hf is not None:
            row["hf_eager"] = hf_decode_ms(hf, args, bs)
        if ceilings:
            row["floor"] = decode_floor_ms(read_bytes, kv_bytes_per_token(model.config), bs, args.context,
                                           ceilings["copy_rate_Bps"])  # fmt: skip
        rows[bs] = row
        print("decode", bs, json.dumps(row), flush=True)
        free_batch(runner, batch)
    return rows


def add_kernel_counts(args, model, runner, whole, rows: dict) -> None:
    """Each decode row's CUDA kernels per layer in one replay of each
    whole-model graph, and where its time and its whole step's go
    (torch.profiler, ``suite_profile.replay_profile``). Run after every timing: once a
    profiler has run, later launches in the process are slower."""
    if args.device != "cuda":
        return
    for bs, row in rows.items():
        batch = step_batch(args, runner, "decode", bs)
        for name, graphs in whole.items():
            graph = graphs.captured_graph(batch.forward_mode, graphs.padded_bs(batch))
            profile = replay_profile(graph.replay)
            layers = model.config.num_hidden_layers
            row[f"{name}_kernels_per_layer"] = profile["kernels"] / layers
            row[f"{name}_profile"] = profile
            # The whole step as timed: input copies, the replay, the LM head (and the host's gaps).
            row[f"{name}_step_profile"] = replay_profile(graph_step_fn(runner, graphs, batch))
        free_batch(runner, batch)


def extend_rows(args, model, runner, piecewise, ceilings) -> dict:
    rows = {}
    read_bytes, nonemb = weight_bytes(model)
    for n in args.extend:
        batch = step_batch(args, runner, "extend", n)
        timed_ro = not args.skip_reduce_overhead and n in args.reduce_overhead_extend
        row = time_paths(step_paths(runner, batch, piecewise, {}, timed_ro))
        if ceilings:
            row["floor"] = extend_floor_ms(read_bytes, nonemb, n, ceilings["copy_rate_Bps"], ceilings["matmul_flops"])
        rows[n] = row
        print("extend", n, json.dumps(row), flush=True)
        free_batch(runner, batch)
    return rows


def run(args) -> None:
    # One code object is compiled once per variant (pieces, whole, reduce-overhead
    # per shape): more than Dynamo's default limit of 8.
    torch._dynamo.config.cache_size_limit = 64
    os.makedirs(args.out, exist_ok=True)
    info = {"shape": args.shape, "config": SHAPES[args.shape], "backend": args.backend, "argv": sys.argv,
            "fused_projections": args.fused_projections,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "card": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "bytecode_written": not sys.dont_write_bytecode}  # fmt: skip
    if sys.dont_write_bytecode:
        # Where torch was installed without its bytecode, every process then compiles
        # the sources of each module it imports: slower start-ups than an installed package's.
        print("warning: PYTHONDONTWRITEBYTECODE is set: where the installed packages hold no bytecode, every "
              "process compiles their sources and the start-up figures include it (unset it, or set "
              "PYTHONPYCACHEPREFIX to a writable folder, and run once before timing)", file=sys.stderr)  # fmt: skip
    model, runner = build(args)
    piecewise, info["startup"] = start_up(runner, args.cache_dir)
    print("startup", json.dumps(info["startup"]), flush=True)
    if args.startup_only:
        json.dump(info, open(os.path.join(args.out, f"startup_{args.shape}.json"), "w"), indent=1)
        return
    whole, info["whole_model_capture"] = whole_model_runners(runner, max(args.decode_bs))
    ceilings = {}
    if args.device == "cuda":
        ceilings = {"copy_rate_Bps": copy_rate(), "matmul_flops": matmul_rate()}
    info.update(ceilings)
    hf = None if args.skip_hf else hf_model(args)
    info["decode"] = decode_rows(args, model, runner, piecewise.compiled, whole, ceilings, hf)
    info["extend"] = extend_rows(args, model, runner, piecewise.compiled, ceilings)
    add_kernel_counts(args, model, runner, whole, info["decode"])
    torch._dynamo.reset()  # reduce-overhead's last graphs
    info["counters"] = counters.as_dict()
    json.dump(info, open(os.path.join(args.out, f"suite_{args.shape}.json"), "w"), indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="measure one shape")
    r.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    r.add_argument("--out", required=True)
    r.add_argument("--device", default="cuda")
    r.add_argument("--backend", default=None, help="default: triton on cuda, torch on the cpu")
    r.add_argument("--context", type=int, default=1024)
    r.add_argument("--decode-bs", type=int, nargs="+", default=[1, 8, 32, 128])
    r.add_argument("--extend", type=int, nargs="+", default=[16, 128, 512])
    r.add_argument("--reduce-overhead-extend", type=int, nargs="*", default=[16, 128, 512])
    r.add_argument("--startup-only", action="store_true", help="only the piecewise start-up (run as a 2nd process)")
    r.add_argument("--cache-dir", default=None, help="compile artifacts: saved by a 1st process, loaded by a 2nd")
    r.add_argument("--fused-projections", action="store_true", help="the model's fused projection ops (one rank)")
    r.add_argument("--skip-hf", action="store_true")
    r.add_argument("--skip-reduce-overhead", action="store_true")
    rep = sub.add_parser("report", help="markdown table and PNG plot of the runs in a folder")
    rep.add_argument("results")
    rep.add_argument("--out", required=True)
    args = p.parse_args()
    if args.command == "run":
        args.backend = args.backend or ("triton" if args.device == "cuda" else "torch")
    if args.command == "report":
        from suite_report import report

        report(args.results, args.out)
    else:
        run(args)


if __name__ == "__main__":
    main()
