"""What the safety checks cost on the decode step (a script, not a test).

Qwen2.5-0.5B shape, bf16, one request at 1024 tokens of context, whole-model
decode graph (``CudaGraphRunner``). Times, side by side in one process:

* the step through ``ModelRunner.forward_step`` with the batch validation
  (``batch_checks.check_batch``, host checks) and with it switched off;
* ``check_batch`` alone (host microseconds);
* the pointer comparison that ties piecewise graphs to the weights they
  captured (``PiecewiseModule._graph_set``), per call.

    python benchmarks/bench_checks.py --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from common import QWEN_05B  # noqa: E402 (benchmarks/ is the script's folder)

import sgl_piecewise as sp
import sgl_piecewise.runner as runner_module
from sgl_piecewise.batch_checks import check_batch
from sgl_piecewise.compile import CompileOptions
from sgl_piecewise.models import ModelConfig, build_random_model
from sgl_piecewise.runner import ModelRunner
from sgl_piecewise.runners.piecewise import PiecewiseCudaGraphRunner
from sgl_piecewise.runners.whole_model import CudaGraphRunner
from sgl_piecewise.testing import place_requests, release_batch


def host_us(fn, iters: int) -> float:
    """Median host time of ``fn`` in microseconds over ``iters`` calls."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def step_ms(runner: ModelRunner, batch, iters: int) -> float:
    """Median wall time of one forward_step (it synchronises the device)."""
    for _ in range(5):
        runner.forward_step(batch)
    times = []
    for _ in range(iters):
        runner.forward_step(batch)
        times.append(runner.step_stats[-1].seconds)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--backend", default="triton")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    config = ModelConfig.from_hf_dict(QWEN_05B)
    model = build_random_model(config, torch.bfloat16, "cuda", seed=0)
    runner = ModelRunner(model, max_reqs=4, max_context_len=args.context + 8, num_slots=4 * args.context,
                         backend=args.backend)  # fmt: skip
    CudaGraphRunner(runner, (1, 2, 4)).capture(progress=False)
    rows, loc = place_requests(runner.req_to_token_pool, runner.kv_pool, [args.context - 1], [1], fill_prefix=False)
    ids = torch.randint(0, config.vocab_size, (1,), device="cuda")
    batch = sp.ForwardBatch.build(sp.ForwardMode.DECODE, ids, rows, [args.context - 1], [1], loc)

    result = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "backend": args.backend,
              "argv": sys.argv, "date": time.strftime("%Y-%m-%d", time.gmtime())}  # fmt: skip
    with torch.no_grad():
        # Alternate the two variants, so drift of the host hits both alike.
        checked, unchecked = [], []
        real_check = runner_module.check_batch
        for _ in range(5):
            checked.append(step_ms(runner, batch, args.iters // 5))
            runner_module.check_batch = lambda *a, **k: None
            unchecked.append(step_ms(runner, batch, args.iters // 5))
            runner_module.check_batch = real_check
        result["decode_bs1_step_ms_checked"] = statistics.median(checked)
        result["decode_bs1_step_ms_unchecked"] = statistics.median(unchecked)
        pools = (runner.req_to_token_pool, runner.kv_pool)
        result["check_batch_us"] = host_us(lambda: check_batch(batch, *pools), args.iters)
        result["check_batch_debug_us"] = host_us(lambda: check_batch(batch, *pools, debug_checks=True), 50)
        release_batch(*pools, batch)
        result["graph_set_key_us"] = graph_set_key_us(runner, args.iters)
    step = result["decode_bs1_step_ms_unchecked"] * 1e3
    result["check_batch_share_of_step"] = result["check_batch_us"] / step
    result["graph_set_key_share_of_step"] = result["graph_set_key_us"] / step
    print(json.dumps(result, indent=1))
    json.dump(result, open(os.path.join(args.out, "checks.json"), "w"), indent=1)


def graph_set_key_us(runner: ModelRunner, iters: int) -> float:
    """Host cost of finding the graph set for a call's weight addresses."""
    options = CompileOptions(cudagraphs=True, capture_sizes=(1, 2), piece_compiler="eager")
    graphs = PiecewiseCudaGraphRunner(runner, options)
    graphs.capture(progress=False)
    (module,) = graphs.compiled.piecewise_modules
    seen = {}
    find = module._graph_set

    def spy(args):  # keep one real call's arguments
        seen["args"] = list(args)
        return find(args)

    module._graph_set = spy
    graphs.capture(progress=False)  # replays each size once through the spy
    return host_us(lambda: find(seen["args"]), iters)


if __name__ == "__main__":
    main()
