"""Where the start-up of the piecewise graphs goes (a script, not a test).

The 0.5b shape of the suite, bf16, ``triton`` attention: compiles the model
and captures the 52 default token counts (``PiecewiseCudaGraphRunner.capture``),
as ``suite.py``'s start-up does, and times its phases on the side: Dynamo's
own figures (``torch._dynamo.utils.compile_times``: the bytecode trace, the
backend), the pieces' compiles, the fake run of the split module that feeds
them, each Triton compile (or load from Triton's cache) of this process and
the thread it ran on, the first size and the other 51. Run it in a fresh
process with empty caches for a cold start::

    export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
    python benchmarks/profile_startup.py --out results/
    python benchmarks/profile_startup.py --out results/ --no-compile-ahead  # (fresh caches again)

``--no-compile-ahead``: the extend kernel's other row tiles are compiled
when first launched, not ahead on background threads (``launch.py``).
``--cache-dir DIR``: save the compile there, or start from the one saved
there (``CompileOptions.cache_dir``; the second process is a warm start).
``--no-compile-child``: the extend kernel is compiled in this process at
its first launch, not by a child process from the backend's creation on
(``compile_child.py``).
``--no-deferred-kernel-waits``: each Inductor piece waits for its kernels
at the end of its own compile, not after the last piece's lowering
(``compile/kernel_waits.py``).
``--no-hash-ahead``: Triton's cache key is computed at the first kernel
Triton looks up, not on a background thread from the backend's creation on
(``launch.hash_triton_sources_ahead``).
The model's build (its weights drawn) is timed too, and with the start-up:
work moved out of the start-up may land in the build.
Each graph capture is timed too (the pieces', and the metadata fill's per
size): beginning it, the whole of it, ending it (CUDA's instantiation
included). Needs CUDA.

A warm start assumes Python's bytecode is cached too, as in any installed
environment: where ``PYTHONDONTWRITEBYTECODE`` is set (some containers set
it), every process compiles the sources of the torch modules it imports
again (1.7 s of a warm start profiled on an H100 host). Unset it, or point
``PYTHONPYCACHEPREFIX`` at a writable folder, before the first process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time
import types
from collections import Counter

import suite
import torch
from common import NO_INDUCTOR_AUTOTUNE_HELP, timed, turn_off_inductor_autotune  # noqa: E402 (benchmarks/ is the script's folder)
from triton.runtime.jit import JITFunction

from sgl_piecewise.backends import triton_backend
from sgl_piecewise.backends.triton_kernels import compile_child, extend
from sgl_piecewise.compile import CompileOptions, counters, kernel_waits
from sgl_piecewise.compile import backend as compile_backend
from sgl_piecewise.compile.piece_compiler import PieceCompiler
from sgl_piecewise.runners import PiecewiseCudaGraphRunner
from sgl_piecewise.runners.capture import GraphCapture


def triton_compiles(since: float) -> list:
    """Wrap Triton's JIT compile (or cache load) for good: the returned list
    gets a row per compile, with its kernel, thread, start and seconds."""
    rows, do_compile = [], JITFunction._do_compile

    def timed_compile(fn, *args, **kwargs):
        t = time.perf_counter()
        try:
            return do_compile(fn, *args, **kwargs)
        finally:
            main = threading.current_thread() is threading.main_thread()
            rows.append({"kernel": fn.fn.__name__, "thread": "main" if main else "background",
                         "at_s": round(t - since, 3), "seconds": round(time.perf_counter() - t, 3)})  # fmt: skip

    JITFunction._do_compile = timed_compile
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--no-compile-ahead", action="store_true")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--no-hash-ahead", action="store_true")
    p.add_argument("--no-compile-child", action="store_true")
    p.add_argument("--no-deferred-kernel-waits", action="store_true")
    p.add_argument("--no-inductor-autotune", action="store_true", help=NO_INDUCTOR_AUTOTUNE_HELP)
    cli = p.parse_args()
    if cli.no_inductor_autotune:
        turn_off_inductor_autotune()
    if cli.no_compile_ahead:
        extend._launch_extend.variants = None
    if cli.no_hash_ahead:
        triton_backend.hash_triton_sources_ahead = lambda: None
    if cli.no_compile_child:
        os.environ[compile_child.ENV_SWITCH] = "0"
    if cli.no_deferred_kernel_waits:
        compile_backend._kernel_waits = lambda options: contextlib.nullcontext()
    args = types.SimpleNamespace(shape="0.5b", device="cuda", backend="triton", context=1024,
                                 decode_bs=[1, 8, 32], extend=[16])  # fmt: skip
    build_start = time.perf_counter()
    model, runner = suite.build(args)
    build_seconds = time.perf_counter() - build_start
    phases = [
        (compile_backend._CompilePieces, "run", "split module's fake run, piece compiles included"),
        (PieceCompiler, "__call__", "piece compiles"),
        (vars(kernel_waits), "wait_for_all", "deferred kernel waits"),
        *[(GraphCapture, name, f"graph captures (pieces and metadata fills): {name}")
          for name in ("record", "begin_graph", "end_graph")],
    ]  # fmt: skip
    piecewise = PiecewiseCudaGraphRunner(runner, CompileOptions(cudagraphs=True, cache_dir=cli.cache_dir))
    totals, calls = Counter(), Counter()  # nanoseconds and calls per phase
    first_phases = []  # the phases' totals when the first size is done
    dummy_forward = piecewise._dummy_forward

    def size_then_note(num_tokens):
        dummy_forward(num_tokens)
        if not first_phases:
            first_phases.append(Counter(totals))

    piecewise._dummy_forward = size_then_note
    compiles = triton_compiles(since=time.perf_counter())
    with timed(phases, totals, calls):
        seconds = piecewise.capture(progress=False)
    first, others = piecewise.first_size_seconds, seconds - piecewise.first_size_seconds
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    dynamo = {name: round(float(value), 3) for name, value in zip(names, values)}
    info = {
        "shape": args.shape, "torch": torch.__version__, "card": torch.cuda.get_device_name(),
        "compile_ahead": not cli.no_compile_ahead, "hash_ahead": not cli.no_hash_ahead,
        "compile_child": compile_child.child_answers(),
        "deferred_kernel_waits": not cli.no_deferred_kernel_waits,
        "kernel_waits_deferred": counters.kernel_waits_deferred,
        "build_seconds": round(build_seconds, 3), "build_and_capture_seconds": round(build_seconds + seconds, 3),
        "inductor_autotune": not cli.no_inductor_autotune,
        "from_saved_compile": counters.compiles_loaded > 0,
        "seconds": round(seconds, 3), "first_size_seconds": round(first, 3), "other_sizes_seconds": round(others, 3),
        "phases_seconds": {k: round(v / 1e9, 3) for k, v in totals.items()},
        "other_sizes_phases_seconds": {k: round((v - first_phases[0][k]) / 1e9, 3) for k, v in totals.items()},
        "piece_graphs_captured": counters.graphs_captured,
        "dynamo_seconds": {k: dynamo[k] for k in ("bytecode_tracing", "OutputGraph.call_user_compiler") if k in dynamo},
        "dynamo_timed_seconds": dict(sorted(dynamo.items(), key=lambda kv: -kv[1])),  # every timer torch keeps
        "triton_compiles": compiles,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in info.items() if k != "triton_compiles"}, indent=1))
    for row in compiles:
        print(f"  triton {row['kernel']:24s} {row['thread']:10s} at {row['at_s']:7.3f} s  {row['seconds']:.3f} s")
    os.makedirs(cli.out, exist_ok=True)
    name = "profile_startup_0.5b" + ("_no_compile_ahead" if cli.no_compile_ahead else "")
    name += "_no_hash_ahead" if cli.no_hash_ahead else ""
    name += "_no_compile_child" if cli.no_compile_child else ""
    name += "_no_deferred_kernel_waits" if cli.no_deferred_kernel_waits else ""
    name += "_no_inductor_autotune" if cli.no_inductor_autotune else ""
    name += "_from_saved_compile.json" if info["from_saved_compile"] else ".json"
    json.dump(info, open(os.path.join(cli.out, name), "w"), indent=1)


if __name__ == "__main__":
    main()
