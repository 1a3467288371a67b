"""Where the start-up of the piecewise graphs goes (a script, not a test).

The 0.5b shape of the suite, bf16, ``triton`` attention: builds the model
(random weights) and its ``ModelRunner``, then compiles the model and
captures the 52 default token counts (``PiecewiseCudaGraphRunner.capture``),
as ``suite.py``'s start-up does. Reports the build, the start-up, its first
size (Dynamo's trace and the piece compiles, or the load of a saved compile,
and that size's capture) and the other 51 sizes, with Dynamo's own timers
(``torch._dynamo.utils.compile_times``: the bytecode trace, the backend).

    export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
    python benchmarks/profile_startup.py --out results/                         # cold
    python benchmarks/profile_startup.py --out results/ --cache-dir compiles    # cold, saving the compile
    python benchmarks/profile_startup.py --out results/ --cache-dir compiles    # warm: from the saved compile

A warm start assumes Python's bytecode is cached, as in any installed
environment: where ``PYTHONDONTWRITEBYTECODE`` is set (some containers set
it), every process compiles the sources of the torch modules it imports
again. Unset it, or point ``PYTHONPYCACHEPREFIX`` at a writable folder, and
run once before timing. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import time
import types

import suite
import torch
from common import write_json  # noqa: E402 (benchmarks/ is the script's folder)

from sgl_piecewise.compile import CompileOptions, counters
from sgl_piecewise.runners import PiecewiseCudaGraphRunner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cache-dir", default=None, help="save the compile there, or start from the one saved there")
    cli = p.parse_args()
    args = types.SimpleNamespace(shape="0.5b", device="cuda", backend="triton", context=1024,
                                 decode_bs=[1, 8, 32], extend=[16])  # fmt: skip
    build_start = time.perf_counter()
    model, runner = suite.build(args)
    build_seconds = time.perf_counter() - build_start
    piecewise = PiecewiseCudaGraphRunner(runner, CompileOptions(cudagraphs=True, cache_dir=cli.cache_dir))
    seconds = piecewise.capture(progress=False)
    first = piecewise.first_size_seconds
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    dynamo = {name: round(float(value), 3) for name, value in zip(names, values)}
    info = {
        "shape": args.shape, "torch": torch.__version__, "card": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "build_seconds": round(build_seconds, 3), "build_and_capture_seconds": round(build_seconds + seconds, 3),
        "from_saved_compile": counters.compiles_loaded > 0, "compile_saved": counters.compiles_saved > 0,
        "sizes": len(piecewise.options.capture_sizes),
        "seconds": round(seconds, 3), "first_size_seconds": round(first, 3),
        "other_sizes_seconds": round(seconds - first, 3),
        "piece_graphs_captured": counters.graphs_captured,
        "dynamo_seconds": {k: dynamo[k] for k in ("bytecode_tracing", "OutputGraph.call_user_compiler") if k in dynamo},
        "dynamo_timed_seconds": dict(sorted(dynamo.items(), key=lambda kv: -kv[1])),  # every timer torch keeps
    }  # fmt: skip
    print(json.dumps(info, indent=1))
    name = "profile_startup_0.5b" + ("_from_saved_compile.json" if info["from_saved_compile"] else ".json")
    write_json(cli.out, name, info)


if __name__ == "__main__":
    main()
