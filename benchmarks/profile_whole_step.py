"""Where a whole-model decode step's time goes (a script, not a test).

A shape of the suite (``--shape``, 0.5b by default), bf16, ``triton``
attention, context 1024, the whole-model graphs recording the model compiled
whole. At decode batch 1, 8 and 32 it times, each alone (median of
CUDA-event timings, and the host time to enqueue it): the whole step; its
parts in order (the registry's fill of the graph inputs, the replay hook,
the graph's replay, the LM head on a copy of the output); and the attention
metadata fill of the step's binding three ways: the one-launch kernel
(``fill_paged_metadata``, what the graph records), the torch helpers it
replaced (some 25 launches), and those helpers recorded as one graph (how
replays ran them before). Then the step's phases as the card and the host
see them, over synchronised steps after a warm-up: CUDA events at the
step's start, just before and after the graph's replay and at its end
(``before graph`` is what the card waits for the host), and the host's
time to the replay's launch and to the step's last launch. ``--host-parts``: also
the host time of each part inside the step (a ``perf_counter`` timer around
each, about 0.3 µs a call). ``--cprofile``:
also cProfile's top functions over 500 whole steps (host time; the profiler
slows each call, so shares matter, not sums). ``--kernels``: also the kernels of one replay
(torch.profiler), device time per kernel. Needs CUDA.

    python benchmarks/profile_whole_step.py --out results/ [--shape 1b] [--kernels] [--host-parts] [--cprofile]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import statistics
import time
import types

import suite
import torch
from common import (  # noqa: E402 (benchmarks/ is the script's folder)
    NO_INDUCTOR_AUTOTUNE_HELP,
    free_batch,
    graph_step_fn,
    host_ms,
    keep_busy,
    median_ms,
    timed,
    turn_off_inductor_autotune,
    write_json,
)
from profile_suite_step import kernel_table  # noqa: E402

from sgl_piecewise.backends.metadata import fill_kv_indices, fill_lengths
from sgl_piecewise.backends.triton_kernels import choose_num_kv_splits, fill_paged_metadata
from sgl_piecewise.compile import CompiledModel, CompileOptions
from sgl_piecewise.forward import ForwardMode
from sgl_piecewise.runner import ModelRunner
from sgl_piecewise.runners import CudaGraphRunner, whole_model
from sgl_piecewise.runners.buffer_registry import CudaGraphBufferRegistry, FillContext
from sgl_piecewise.runners.capture import shared_capture
from sgl_piecewise.runners.whole_model import default_capture_sizes


def metadata_fills(backend, meta, rows, seq_lens) -> dict:
    """The binding's fill three ways, each a callable."""
    table = backend.req_to_token_pool.req_to_token

    def one_launch():
        fill_paged_metadata(meta, meta.kv_indices, table, rows, seq_lens, None,
                            meta.num_kv_splits, backend.max_kv_splits)  # fmt: skip

    def torch_helpers():
        fill_lengths(meta, seq_lens, None)
        fill_kv_indices(meta.kv_indices, table, rows, meta.kv_indptr)
        choose_num_kv_splits(meta.kv_lens, backend.max_kv_splits, meta.num_kv_splits)

    torch_helpers()  # warm: the recording must not be the first run
    graph, _ = shared_capture(backend.kv_pool.device).record(torch_helpers, "torch helpers' fill")
    return {"metadata fill, one launch": one_launch, "metadata fill, torch helpers": torch_helpers,
            "metadata fill, torch helpers as a graph": graph.replay}  # fmt: skip


def parts(runner, graphs, batch) -> dict:
    """The step and each of its parts, as callables."""
    mode, bs = ForwardMode.DECODE, batch.batch_size
    padded = graphs.padded_bs(batch)
    static, graph = graphs._static[(mode, padded)], graphs.captured_graph(mode, padded)
    output = graphs._outputs[(mode, padded)]
    registry, ctx = graphs.registries[mode], FillContext.uniform(bs, padded, 1)
    backend = runner.backend

    seq_lens_sum = batch.seq_lens_sum + graphs._seq_len_fill * (padded - bs)

    def hook():
        backend.init_forward_metadata_replay_cuda_graph(
            padded, static.req_pool_indices, static.seq_lens, seq_lens_sum, None, mode, None, static.seq_lens_cpu
        )

    meta = backend._graph_metadata[(mode, padded)]
    fills = metadata_fills(backend, meta, static.req_pool_indices[:padded], static.seq_lens[:padded])
    return {
        "step": graph_step_fn(runner, graphs, batch),
        "registry fill": lambda: registry.fill_from(batch, ctx),
        "replay hook": hook,
        "graph replay": graph.replay,
        "LM head (copy of the output, logits)": lambda: runner.last_token_logits(output[:bs].clone(), batch),
        **fills,
    }


class MarkedGraph:
    """A captured graph whose replay records a CUDA event just before and
    just after it, and the host's clock at its launch."""

    def __init__(self, graph):
        self.graph, self.marks = graph, []

    def replay(self):
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = time.perf_counter()
        before.record()
        self.graph.replay()
        after.record()
        self.marks.append((host, before, after))


def step_phases(runner, graphs, batch, steps: int = 100) -> dict:
    """Medians over ``steps`` synchronised steps: ms on the card before the
    graph, of the graph, after it; µs of host time to the replay's launch
    and to the step's end (its last launch)."""
    key = (ForwardMode.DECODE, graphs.padded_bs(batch))
    graph = graphs._graphs[key]
    marked = graphs._graphs[key] = MarkedGraph(graph)
    run = graph_step_fn(runner, graphs, batch)
    try:
        keep_busy(run)
        marked.marks.clear()
        spans = []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            host = time.perf_counter()
            start.record()
            run()
            end.record()
            host_end = time.perf_counter()
            end.synchronize()
            host_replay, before, after = marked.marks[-1]
            spans.append((start.elapsed_time(before), before.elapsed_time(after), after.elapsed_time(end),
                          1e6 * (host_replay - host), 1e6 * (host_end - host)))  # fmt: skip
    finally:
        graphs._graphs[key] = graph
    names = ("before graph ms", "graph ms", "after graph ms", "host to replay us", "host to end us")
    return {name: statistics.median(span[i] for span in spans) for i, name in enumerate(names)}


def host_parts(runner, graphs, batch, steps: int = 200) -> dict:
    """µs of host time per step in each part of a whole-model step, over
    ``steps`` synchronised steps (the parts nest as indented)."""
    totals, calls = collections.Counter(), collections.Counter()
    components = [
        (CudaGraphRunner, "try_replay", "try_replay"),
        (vars(whole_model), "why_eager", "  why_eager"),
        (CudaGraphRunner, "replay", "  replay"),
        (CudaGraphBufferRegistry, "fill_from", "    registry fill"),
        (type(runner.backend), "init_forward_metadata_replay_cuda_graph", "    replay hook"),
        (torch.cuda.CUDAGraph, "replay", "    CUDAGraph.replay"),
        (ModelRunner, "last_token_logits", "LM head"),
    ]
    run = graph_step_fn(runner, graphs, batch)
    with timed(components, totals, calls):
        keep_busy(run)
        totals.clear()
        start = time.perf_counter_ns()
        for _ in range(steps):
            run()
            torch.cuda.synchronize()
        step_ns = (time.perf_counter_ns() - start) / steps
    parts = {label: totals[label] / steps / 1e3 for _, _, label in components}
    return {"step, host and device": step_ns / 1e3, **parts}


def host_profile(run, steps: int = 500, top: int = 30) -> str:
    """cProfile's ``top`` functions by own time over ``steps`` synchronised steps."""
    profile = cProfile.Profile()
    for _ in range(steps):
        profile.enable()
        run()
        profile.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--shape", choices=["0.5b", "1b"], default="0.5b")
    p.add_argument("--kernels", action="store_true", help="also the kernels of one replay (torch.profiler)")
    p.add_argument("--host-parts", action="store_true", help="also the host time of each part of the step")
    p.add_argument("--cprofile", action="store_true", help="also cProfile's top functions of the step (host)")
    p.add_argument("--no-inductor-autotune", action="store_true", help=NO_INDUCTOR_AUTOTUNE_HELP)
    cli = p.parse_args()
    if cli.no_inductor_autotune:
        turn_off_inductor_autotune()
    args = types.SimpleNamespace(shape=cli.shape, device="cuda", backend="triton", context=1024,
                                 decode_bs=cli.decode_bs, extend=[16])  # fmt: skip
    model, runner = suite.build(args)
    compiled = CompiledModel(runner.model, CompileOptions(split_graph=False))
    graphs = CudaGraphRunner(runner, default_capture_sizes(max(cli.decode_bs)), forward=compiled)
    graphs.capture(progress=False)
    runner.step_graphs = None
    rows = {}
    with torch.no_grad():
        for bs in cli.decode_bs:
            batch = suite.step_batch(args, runner, "decode", bs)
            rows[bs] = {name: {"ms": median_ms(fn, 10, 100), "host_us": 1e3 * host_ms(fn, 100)}
                        for name, fn in parts(runner, graphs, batch).items()}  # fmt: skip
            for name, row in rows[bs].items():
                print(f"decode bs {bs:3d}  {name:42s} {row['ms']:7.3f} ms  host {row['host_us']:6.1f} us", flush=True)
            rows[bs]["step phases"] = step_phases(runner, graphs, batch)
            print(f"decode bs {bs:3d}  step phases {rows[bs]['step phases']}", flush=True)
            if cli.host_parts:
                rows[bs]["host parts us"] = host_parts(runner, graphs, batch)
                print(f"decode bs {bs:3d}  host parts {rows[bs]['host parts us']}", flush=True)
            if cli.cprofile:
                rows[bs]["cprofile"] = host_profile(graph_step_fn(runner, graphs, batch))
                print(rows[bs]["cprofile"], flush=True)
            free_batch(runner, batch)
        # Last: once torch.profiler has run, later launches in this process
        # take longer on the host.
        for bs in cli.decode_bs if cli.kernels else ():
            batch = suite.step_batch(args, runner, "decode", bs)
            print(f"decode bs {bs:3d}  kernels of one replay", flush=True)
            # Through try_replay: the graph reads this batch, not the last capture's.
            rows[bs]["replay kernels"] = kernel_table(lambda b=batch: graphs.try_replay(b))
            free_batch(runner, batch)
    info = {"shape": args.shape, "torch": torch.__version__, "card": torch.cuda.get_device_name(),
            "inductor_autotune": not cli.no_inductor_autotune, "decode": rows}  # fmt: skip
    write_json(cli.out, f"profile_whole_step_{args.shape}.json", info)


if __name__ == "__main__":
    main()
