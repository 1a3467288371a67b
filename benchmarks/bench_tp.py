"""Decode step time of one model shape at tensor-parallel sizes 1 and N, side
by side, in one run (a script, not a test).

    python benchmarks/bench_tp.py --out results/      # 2 GPUs: Llama-3-8B shape, bf16, TP 1 and 2
    python benchmarks/bench_tp.py --shape tiny --device cpu --dtype float32 --decode-bs 1 2 \\
        --context 16 --iters 2 --out /tmp/smoke       # the logic on a CPU (gloo)

Each TP size runs in its own ``distributed.launch`` (TP 1 first). In every
rank: the shape's model with random weights in ``--dtype`` on the rank's
device (its shard), then for each ``--paths`` entry and each all-reduce
variant a ``ModelRunner`` (``graphs="full"`` for ``whole_model``,
``"piecewise"`` for ``piecewise``), its graphs captured for exactly the
``--decode-bs`` sizes, and a DECODE batch of ``bs`` requests with
``--context`` tokens of prefix each (stand-in random K/V) timed through
``runner.forward_step`` (validation, dispatch, replay, logits and the
step's synchronisation): ``--warmup`` steps, then the median of ``--iters``
steps, each timed with CUDA events (wall time on a CPU). Every rank runs
every step, so rank 0's time is the group's step time. A whole-model row
also gives the device time of its graph alone (``replay_ms``: replays of
the step's batch launched back to back, so the host's work between steps
is left out).

All-reduce variants at TP > 1 on CUDA (``--comm``, ``all`` by default):
``fused``, the library's default where FlashInfer is installed: each
row-parallel projection's all-reduce through FlashInfer's one-shot kernel,
the residual add and the next RMSNorm in it (rows up to
``fused_norm.FUSED_MAX_ROW_BYTES``) or in our kernel after it
(``distributed/fused_norm.py``), the embedding's all-reduce through
one-shot symmetric memory; ``symm``: the same model with that op turned
off (``models.norm.fuse_all_reduce_norms``): every all-reduce of at most
``SMALL_ALL_REDUCE_MAX_BYTES`` through torch's symmetric-memory kernels,
the add and the norm apart;
``nccl``: every all-reduce through NCCL, unfused: its runners are captured
and run inside ``distributed.nccl_only_all_reduces()`` (the graphs keep the
path taken at capture). ``prepare_communication`` (once per rank, before
any capture) allocates the buffers. Each row records the one-shot buffer's
size and the path its small all-reduces took (``small_all_reduce``), and
the profile names the collective kernels that ran (a fused kernel's time
includes its add and norm). At TP 1 there is no all-reduce (comm ``none``);
on a CPU the one path is gloo (comm ``gloo``).

Where the step's device time goes (CUDA only, after every timing, as a
profiler slows the launches that follow it): ``torch.profiler`` over
``--profile-steps`` steps on every rank, the summed device time of the
kernels whose name contains ``allreduce``, ``all_reduce``, ``nccl`` or
``one_shot`` (the all-reduces, and the LM head's all-gather) over the
summed time of every kernel of those steps, rank 0's share. A collective
kernel's time includes its wait for the slower rank. The profile also
gives the device's idle time a step (between the profiled steps' first
and last kernel, the time no kernel or copy runs) and its eight longest
stretches, each with the kernels around it; the kernels' time a step by
class (``KERNEL_CLASSES``: matmul, attention, norm, ...), which shows
what does not shrink with a rank's shard; and the twelve longest kernels.

``--sequence-parallel on`` (or ``both``) runs each TP size above 1 with
the residual stream split across the ranks by tokens as well (rows marked
``sp``): the row-parallel projections reduce-scatter and the
column-parallel ones all-gather first, each through NCCL.

``--shard-alone N [N ...]``: for each N, one more launch of one rank whose
model is one rank's shard of TP N as a plain model (its heads, KV heads,
MLP columns and vocabulary; rows ``tp 1/N``): TP N's kernels with no
communication, which splits a TP N step's excess over ``1/N`` of TP 1's
into the shard's own kernels and the collectives (one GPU is enough).
``--fused-projections`` (with ``--tp 1``): TP 1 and the shards alone with
the model's projections through the fused ops
(``models.set_fused_projections``), which run one rank.

Weights: ``--fast-init`` (the default on CUDA) fills each rank's shard on
its device with ``torch.randn`` under a fixed seed (``std`` 0.02, norm
scales 1): ``build_random_model`` draws every full weight on the CPU in
float32 on every rank (2.4 s per 10^8 values on a 2-core CPU: a minute
or more for 8B). Fast-init weights of TP 1 and TP N
are not the same model; for a speed benchmark they need not be.

Output: a line per row as it is measured, a table at the end, and
``bench_tp_<shape>.json`` in ``--out`` (card, torch, date, the
arguments, the rows), rewritten after every row. A failing row (or
launch) is recorded with its error and the rest still run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional

import torch
from common import SHAPES, free_batch, make_batch, step_times_ms  # noqa: E402 (benchmarks/ is the script's folder)
from suite_profile import kernel_class  # noqa: E402

import sgl_piecewise as sp
from sgl_piecewise.distributed import (
    SMALL_ALL_REDUCE_MAX_BYTES,
    fused_norm,
    launch,
    nccl_only_all_reduces,
    prepare_communication,
    symmetric_buffer_bytes,
    tensor_parallel,
)
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.models import ModelConfig, build_random_model, set_fused_projections
from sgl_piecewise.models.hf_weights import new_model
from sgl_piecewise.models.layers import RMSNorm
from sgl_piecewise.models.norm import fuse_all_reduce_norms
from sgl_piecewise.models.parallel import tp_layout
from sgl_piecewise.runners.dispatch import token_split

PATHS = {"whole_model": "full", "piecewise": "piecewise"}  # timed path -> ModelRunner graphs= policy
COMMS = ("fused", "symm", "nccl")  # all-reduce variants at TP > 1 on CUDA (module docstring)
INIT_STD = 0.02


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes, each in its own launch")
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 32])
    p.add_argument("--context", type=int, default=1024, help="prefix tokens per request in the KV cache")
    p.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    p.add_argument("--comm", choices=("all", *COMMS), default="all", help="all-reduce variants at TP > 1")
    p.add_argument("--sequence-parallel", choices=("off", "on", "both"), default="off",
                   help="at TP > 1: without, with, or both (module docstring)")  # fmt: skip
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default=None, help="default: triton on cuda, torch on the cpu")
    p.add_argument("--piece-compiler", default=None, help="default: inductor on cuda, eager on the cpu")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=None, help="default: 10 on cuda, 2 on the cpu")
    p.add_argument("--profile-steps", type=int, default=5, help="0: no profile (never on the cpu)")
    p.add_argument("--fast-init", action=argparse.BooleanOptionalAction, default=None,
                   help="draw weights on the device (default on cuda; module docstring)")  # fmt: skip
    p.add_argument("--shard-alone", type=int, nargs="+", default=[], metavar="N",
                   help="also time one rank's shard of TP N alone, on one rank (module docstring)")  # fmt: skip
    p.add_argument("--fused-projections", action="store_true",
                   help="the model's projections through the fused ops (one rank: --tp 1, --shard-alone)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch (and per collective wait)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.tp = sorted(set(args.tp))
    args.decode_bs = sorted(set(args.decode_bs))
    args.backend = args.backend or ("triton" if cuda else "torch")
    args.piece_compiler = args.piece_compiler or ("inductor" if cuda else "eager")
    args.warmup = (10 if cuda else 2) if args.warmup is None else args.warmup
    args.fast_init = cuda if args.fast_init is None else args.fast_init
    if not hasattr(torch, args.dtype) or not isinstance(getattr(torch, args.dtype), torch.dtype):
        p.error(f"--dtype: expected a torch dtype name, got {args.dtype!r}")
    if min(args.tp) < 1 or min(args.decode_bs) < 1 or args.context < 1 or args.iters < 1:
        p.error("--tp, --decode-bs, --context and --iters: expected positive ints")
    if any(n < 2 for n in args.shard_alone):
        p.error(f"--shard-alone: expected TP sizes of at least 2, got {args.shard_alone}")
    args.shard_alone = sorted(set(args.shard_alone))
    if args.fused_projections and args.tp != [1]:
        p.error(f"--fused-projections: expected --tp 1 (the fused ops run one rank; --shard-alone N times "
                f"one rank's shard of TP N), got --tp {' '.join(map(str, args.tp))}")  # fmt: skip
    return args


def tp_label(size: int, sequence_parallel: bool, shard_of: Optional[int] = None) -> str:
    """A TP size as rows and logs name it: ``2``, ``2+sp`` with sequence
    parallelism, ``1/2`` for one rank's shard of TP 2 alone."""
    if shard_of:
        return f"1/{shard_of}"
    return f"{size}{'+sp' if sequence_parallel else ''}"


def shape_config(opts: dict) -> ModelConfig:
    """The shape's model, or with ``opts["shard_of"]`` N, one rank's shard of
    it at TP N as a whole model (the layout ``tp_layout`` gives rank 0)."""
    hf = SHAPES[opts["shape"]]
    config = ModelConfig.from_hf_dict(hf)
    if not opts.get("shard_of"):
        return config
    layout = tp_layout(config, 0, opts["shard_of"])
    shard = dict(hf, num_attention_heads=layout.num_heads, num_key_value_heads=layout.num_kv_heads,
                 head_dim=layout.head_dim, intermediate_size=layout.intermediate_size,
                 vocab_size=layout.vocab_per_rank)  # fmt: skip
    return ModelConfig.from_hf_dict(shard)


def comm_variants(opts: dict, tp_size: int) -> List[str]:
    if tp_size == 1:
        return ["none"]
    if not opts["device"].startswith("cuda"):
        return ["gloo"]  # no symmetric memory off CUDA: one path
    comms = list(COMMS) if opts["comm"] == "all" else [opts["comm"]]
    return [c for c in comms if c != "fused" or fused_norm.AVAILABLE]


def fused_norm_step(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A decode step's rows of one request, to ask whether a fused-norm workspace serves it."""
    return torch.empty(1, config.hidden_size, dtype=dtype, device=device)


def small_all_reduce(comm: str):
    """``nccl``: every all-reduce issued or captured inside goes through NCCL
    (``distributed.nccl_only_all_reduces``); else nothing changes."""
    return nccl_only_all_reduces() if comm == "nccl" else contextlib.nullcontext()


def small_all_reduce_path(comm: str, buffer_bytes: int, fused: bool) -> str:
    """What a decode step's all-reduces run: ``fused_norm`` (FlashInfer's
    kernel, with the add and norm or before them), ``one_shot`` (symmetric memory),
    ``nccl``, ``gloo``, or ``none`` (one rank)."""
    if comm == "fused" and fused:
        return "fused_norm"
    if comm in ("fused", "symm"):
        return "one_shot" if buffer_bytes else "nccl"
    return comm


# ---- in each rank -----------------------------------------------------------
def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, fast: bool, seed: int = 0):
    """This rank's shard: ``build_random_model``, or with ``fast`` drawn on the device."""
    if not fast:
        return build_random_model(config, dtype, device, seed=seed, std=INIT_STD)
    model = new_model(config, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed + 1009 * tensor_parallel().rank)
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) in norms:
                p.fill_(1.0)
            else:
                p.normal_(0.0, INIT_STD, generator=gen)
    return model.eval()


def build_runner(model, opts: dict, path: str) -> ModelRunner:
    most = max(opts["decode_bs"])
    runner = ModelRunner(model, max_reqs=most + 1, max_context_len=opts["context"] + 8,
                         num_slots=most * (opts["context"] + 1) + 64, backend=opts["backend"],
                         graphs=PATHS[path])  # fmt: skip
    for layer in range(runner.kv_pool.num_layers):  # stand-in cache contents: random, not zeros
        runner.kv_pool.k_buffers[layer].normal_()
        runner.kv_pool.v_buffers[layer].normal_()
    return runner


def decode_batch(runner: ModelRunner, opts: dict, bs: int):
    torch.manual_seed(bs)  # every rank the same token ids
    return make_batch(runner, sp.ForwardMode.DECODE, [opts["context"]] * bs, [1] * bs)


def lockstep_times_ms(step: Callable[[], object], warmup: int, iters: int, cuda: bool) -> List[float]:
    """A fixed count of steps (the ranks step in lockstep: no time-based warm-up)."""
    for _ in range(warmup):
        step()
    return step_times_ms(step, iters, cuda)


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int, groups: int = 5) -> float:
    """Device time of one replay of ``graph``: ``groups`` runs of ``iters``
    replays launched back to back (the host runs ahead, so no launch or
    host work lies between them), the median of their means."""
    for _ in range(3):
        graph.replay()
    means = []
    for _ in range(groups):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        means.append(start.elapsed_time(end) / iters)
    return statistics.median(means)


def comm_share(step: Callable[[], object], steps: int) -> dict:
    """Share of the kernels' device time in collective kernels over ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total, kernels, classes, names, spans = 0.0, {}, {}, {}, []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        total += us
        spans.append((e.time_range.start, e.time_range.end, e.name[:80]))
        kind = kernel_class(e.name)
        classes[kind] = classes.get(kind, 0.0) + us / steps
        names[e.name[:120]] = names.get(e.name[:120], 0.0) + us / steps
        if kind == "collective":
            kernels[e.name[:120]] = kernels.get(e.name[:120], 0.0) + us / steps
    top = dict(sorted(names.items(), key=lambda item: -item[1])[:12])
    comm = classes.get("collective", 0.0)  # a step's
    return {"share": comm * steps / total if total else None, "comm_us_per_step": comm,
            "kernel_us_per_step": total / steps, "comm_kernels_us_per_step": kernels,
            "kernel_us_per_step_by_class": classes, "top_kernels_us_per_step": top,
            "gpu_idle_us_per_step": idle_us(spans) / steps,
            "longest_idle_gaps": [dict(zip(("us", "after", "before"), g)) for g in idle_gaps(spans)[:8]]}  # fmt: skip


def idle_us(spans: List[tuple]) -> float:
    """Time between the first start and the last end of ``spans`` (``(start,
    end, ...)`` in µs) that none of them covers: the device's idle time
    between the profiled steps' first and last kernel."""
    return sum(gap for gap, _, _ in idle_gaps(spans))


def idle_gaps(spans: List[tuple]) -> List[tuple]:
    """Each stretch no span covers, as ``(µs, what ran before, what ran
    after)`` (a span's third item, where it has one), longest first."""
    gaps, reach, last = [], None, None
    for span in sorted(spans):
        start, end, name = span[0], span[1], span[2] if len(span) > 2 else None
        if reach is not None and start > reach:
            gaps.append((start - reach, last, name))
        if reach is None or end >= reach:
            reach, last = end, name
    return sorted(gaps, key=lambda g: -g[0])


def agree(tp, error: Optional[str]) -> Optional[str]:
    """Every rank's error, if any rank had one: all ranks then skip alike."""
    errors = [e for e in tp.all_gather_object(error) if e]
    return errors[0] if errors else None


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:500]}"


def run_rank(opts: dict, json_path: str) -> Optional[list]:
    """One rank of one TP size: rows recorded by rank 0 as they are measured."""
    tp = tensor_parallel()
    device = tp.device or torch.device(opts["device"])
    dtype = getattr(torch, opts["dtype"])
    config = shape_config(opts)
    comms = comm_variants(opts, tp.size)
    label = tp_label(tp.size, tp.splits_sequence, opts.get("shard_of"))
    name = f"tp {label}"
    rows: list = []

    def record(row: dict) -> None:
        rows.append(row)
        if tp.is_first:
            record_row(json_path, row)

    start = time.perf_counter()
    model = build_model(config, dtype, device, opts["fast_init"])
    fused_modules = set_fused_projections(model, True) if opts.get("fused_projections") else 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    info = {"init_s": time.perf_counter() - start,
            "weights_gib_per_rank": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30,
            "num_local_heads": getattr(model, "num_local_heads", None),
            "num_local_kv_heads": getattr(model, "num_local_kv_heads", None),
            "fused_projection_modules": fused_modules}  # fmt: skip
    if {"fused", "symm"} & set(comms):  # before any capture
        try:
            prepare_communication(max(opts["decode_bs"]), config.hidden_size, dtype, device)
        except Exception as e:  # the symm rows then record a buffer of 0 bytes: NCCL
            info["prepare_communication_error"] = error_text(e)
            traceback.print_exc()
    info["symmetric_buffer_bytes"] = symmetric_buffer_bytes()
    info["fused_norm_workspace"] = (
        tp.size > 1 and fused_norm.serving(tp.group_name, fused_norm_step(config, dtype, device)) is not None
    )
    if tp.is_first:
        card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        record_rank_info(json_path, label, info, card)
        say(f"[{name}] model built in {info['init_s']:.1f} s, {info['weights_gib_per_rank']:.2f} GiB per "
            f"rank; symmetric buffer {info['symmetric_buffer_bytes']} B")  # fmt: skip

    kept = []  # (row, runner) of every timed row, for the profile
    for path in opts["paths"]:
        for comm in comms:
            unit = {"shape": opts["shape"], "tp": tp.size, "sp": tp.splits_sequence, "shard_of": opts.get("shard_of"),
                    "comm": comm, "path": path}  # fmt: skip
            unit["symmetric_buffer_bytes"] = info["symmetric_buffer_bytes"] if comm in ("fused", "symm") else 0
            fused = fuse_all_reduce_norms(model, comm == "fused") > 0 and comm == "fused"  # from the next trace on
            unit["small_all_reduce"] = small_all_reduce_path(comm, unit["symmetric_buffer_bytes"], fused)
            with small_all_reduce(comm):
                runner, error, capture_s = capture_unit(tp, model, opts, path)
                if error:
                    for bs in opts["decode_bs"]:
                        record({**unit, "bs": bs, "ms": None, "error": f"build/capture: {error}"})
                    continue
                if tp.is_first:
                    say(f"[{name}] {path} {comm}: captured in {capture_s:.1f} s")
                for bs in opts["decode_bs"]:
                    row = {**unit, "bs": bs, "ms": None, "capture_s": capture_s,
                           "kv_pool_heads": runner.kv_pool.num_kv_heads}  # fmt: skip
                    time_row(tp, runner, opts, row)
                    record(row)
                    if not row.get("error"):
                        kept.append((row, runner))
    if device.type == "cuda" and opts["profile_steps"] > 0:
        for row, runner in kept:
            with small_all_reduce(row["comm"]):
                profile_row(tp, runner, opts, row)
            if tp.is_first:
                record_row(json_path, row)
    return rows if tp.is_first else None


def capture_unit(tp, model, opts: dict, path: str) -> tuple:
    """``(runner, error, seconds)``: a runner of ``path``'s policy, its graphs
    captured for the decode sizes; an error on any rank is every rank's."""
    runner, error, start = None, None, time.perf_counter()
    try:
        runner = build_runner(model, opts, path)
        sizes = opts["decode_bs"]
        # Under sequence parallelism a whole-model graph's batch is a multiple
        # of the ranks: a batch of 1 replays the graph of 2.
        split = token_split()
        graph_bs = sorted({-(-bs // split) * split for bs in sizes})
        runner.capture_graphs(progress=False, capture_bs=graph_bs, capture_sizes=sizes,
                              piece_compiler=opts["piece_compiler"])  # fmt: skip
    except Exception as e:
        error = error_text(e)
        traceback.print_exc()
    error = agree(tp, error)
    return (None if error else runner), error, time.perf_counter() - start


def time_row(tp, runner: ModelRunner, opts: dict, row: dict) -> None:
    """``row``'s ms (median, min, max) and the path its steps took, or its error."""
    error = None
    cuda = runner.device.type == "cuda"
    try:
        batch = decode_batch(runner, opts, row["bs"])
        try:
            tp.barrier()
            times = lockstep_times_ms(lambda: runner.forward_step(batch), opts["warmup"], opts["iters"], cuda)
            row.update(ms=statistics.median(times), ms_min=min(times), ms_max=max(times),
                       step_path=runner.step_stats[-1].path)  # fmt: skip
            graph = runner.step_graphs.captured_graph(sp.ForwardMode.DECODE, row["bs"]) if runner.step_graphs else None
            if graph is not None:  # its buffers hold this batch, from the last step
                row["replay_ms"] = replay_ms(graph, opts["iters"])
        finally:
            free_batch(runner, batch)
    except Exception as e:
        error = error_text(e)
        traceback.print_exc()
    error = agree(tp, error)
    if error:
        row.update(ms=None, error=error)
    elif row["step_path"] != row["path"]:
        row["error"] = f"timed the {row['step_path']} path, not {row['path']}"


def profile_row(tp, runner: ModelRunner, opts: dict, row: dict) -> None:
    """``row``'s collective share of kernel time (rank 0's, and every rank's)."""
    error, share = None, None
    try:
        batch = decode_batch(runner, opts, row["bs"])
        try:
            tp.barrier()
            share = comm_share(lambda: runner.forward_step(batch), opts["profile_steps"])
        finally:
            free_batch(runner, batch)
    except Exception as e:
        error = error_text(e)
    shares = tp.all_gather_object(None if share is None else share["share"])
    error = agree(tp, error)
    if error:
        row["profile_error"] = error
    else:
        row.update(comm_share=share["share"], comm_share_per_rank=shares, profile=share)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- the JSON file (written by the parent and by each launch's rank 0) -------
ROW_KEY = ("shape", "tp", "sp", "shard_of", "comm", "path", "bs")


def load(json_path: str) -> dict:
    with open(json_path) as f:
        return json.load(f)


def save(json_path: str, result: dict) -> None:
    add_ratios(result["rows"])
    tmp = json_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, json_path)  # a reader sees a whole file


def add_ratios(rows: List[dict]) -> None:
    """Each row's ms over TP 1's of the same path and batch size."""
    tp1 = {(r["path"], r["bs"]): r["ms"] for r in rows if r["tp"] == 1 and not r.get("shard_of") and r.get("ms")}
    for r in rows:
        ref = tp1.get((r["path"], r["bs"]))
        r["ratio_to_tp1"] = r["ms"] / ref if ref and r.get("ms") else None


def record_row(json_path: str, row: dict) -> None:
    """Add (or update) ``row`` in the file and print it."""
    result = load(json_path)
    key = tuple(row.get(k) for k in ROW_KEY)
    result["rows"] = [r for r in result["rows"] if tuple(r.get(k) for k in ROW_KEY) != key] + [row]
    save(json_path, result)
    print("row", format_row(next(r for r in result["rows"] if tuple(r.get(k) for k in ROW_KEY) == key)), flush=True)


def record_rank_info(json_path: str, label: str, info: dict, card: str) -> None:
    result = load(json_path)
    result["card"] = card
    result["ranks"][label] = info
    save(json_path, result)


def format_row(r: dict) -> str:
    ms = "-" if r.get("ms") is None else f"{r['ms']:.3f}"
    ratio = "-" if r.get("ratio_to_tp1") is None else f"{r['ratio_to_tp1']:.3f}"
    share = "-" if r.get("comm_share") is None else f"{100 * r['comm_share']:.1f}%"
    idle = r.get("profile", {}).get("gpu_idle_us_per_step")
    idle = "-" if idle is None else f"{idle:.0f}"
    tp = tp_label(r["tp"], r.get("sp", False), r.get("shard_of"))
    replay = "-" if r.get("replay_ms") is None else f"{r['replay_ms']:.3f}"
    line = (f"{r['shape']:>5} {tp:>6} {r['comm']:>5} {r['path']:>12} {r['bs']:>4} {ms:>9} {replay:>9} {ratio:>7} "
            f"{share:>8} {idle:>7}")  # fmt: skip
    return line + (f"  {r['error']}" if r.get("error") else "")


def print_table(result: dict) -> None:
    header = (
        f"{'shape':>5} {'tp':>6} {'comm':>5} {'path':>12} {'bs':>4} {'ms':>9} {'replay ms':>9} {'/tp1':>7} "
        f"{'comm %':>8} {'idle us':>7}"
    )
    print(f"\ndecode step, {result['shape']} shape, {result['dtype']}, context {result['context']}, "
          f"{result['card']}, torch {result['torch']}")  # fmt: skip
    print(header)
    print("-" * len(header))
    order = {p: i for i, p in enumerate(PATHS)}

    def key(r: dict) -> tuple:
        return order[r["path"]], r["bs"], r.get("shard_of") or 0, r["tp"], r.get("sp", False), r["comm"]

    rows = sorted(result["rows"], key=key)
    for r in rows:
        print(format_row(r))
    for r in rows:
        classes = r.get("profile", {}).get("kernel_us_per_step_by_class")
        if classes:
            tp = tp_label(r["tp"], r.get("sp", False), r.get("shard_of"))
            spent = ", ".join(f"{kind} {us:.0f}" for kind, us in sorted(classes.items(), key=lambda item: -item[1]))
            print(f"kernel us a step, tp {tp} {r['comm']} {r['path']} bs {r['bs']}: {spent}")
    for failed in result["launch_errors"]:
        label = tp_label(failed["tp"], failed.get("sp", False), failed.get("shard_of"))
        print(f"tp {label}: launch failed: {failed['error'][:2000]}")


def launches(sizes: List[int], sequence_parallel: str, shard_sizes: List[int] = ()) -> List[tuple]:
    """``(ranks, sequence parallel, shard of)`` of each launch, in order:
    TP 1 alone; then one rank of each of ``shard_sizes``' shards."""
    modes = {"off": [False], "on": [True], "both": [False, True]}[sequence_parallel]
    runs = [(size, split, None) for size in sizes for split in (modes if size > 1 else [False])]
    return runs + [(1, False, size) for size in shard_sizes]


def main(argv=None) -> dict:
    args = parse_args(argv)
    opts = vars(args)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, f"bench_tp_{args.shape}.json")
    result: Dict[str, object] = {
        "shape": args.shape, "config": SHAPES[args.shape], "card": None, "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "argv": sys.argv[1:] if argv is None else list(argv),
        "options": opts, "dtype": args.dtype, "context": args.context,
        "small_all_reduce_max_bytes": SMALL_ALL_REDUCE_MAX_BYTES, "ranks": {}, "launches": [],
        "launch_errors": [], "rows": [],
    }  # fmt: skip
    save(json_path, result)
    for size, split, shard_of in launches(args.tp, args.sequence_parallel, args.shard_alone):
        name = f"tp {tp_label(size, split, shard_of)}"
        start = time.perf_counter()
        error = None
        try:
            launch(run_rank, size, {**opts, "shard_of": shard_of}, json_path, device=args.device,
                   timeout_s=args.timeout, sequence_parallel=split)  # fmt: skip
        except Exception as e:
            error = error_text(e) if not hasattr(e, "cause") else f"{type(e).__name__}: {e}"
            print(f"[{name}] launch failed: {error[:3000]}", file=sys.stderr, flush=True)
        seconds = time.perf_counter() - start
        print(f"[{name}] launch done in {seconds:.1f} s", file=sys.stderr, flush=True)
        result = load(json_path)
        result["launches"].append({"tp": size, "sp": split, "shard_of": shard_of, "seconds": seconds, "error": error})
        if error:
            result["launch_errors"].append({"tp": size, "sp": split, "shard_of": shard_of, "error": error})
        save(json_path, result)
    print_table(result)
    return result


if __name__ == "__main__":
    main()
