"""Where the host time of the attention between compiled pieces goes (a
script, not a test).

The 0.5b shape of the suite, bf16, ``triton`` attention, one decode request
with 1023 cached tokens. Each line is the host time of one call, averaged
over 3000 calls launched back to back (after 50 warm-up calls) and
synchronised only at the end: the Python and launch cost, not the kernels'
device time. From the whole attention op down to its one launch, the
unfused K/V write other backends still pay, and, for scale, an empty Triton
kernel launched the usual way, through ``FastLauncher`` and as a bound
kernel given addresses; a small graph replayed by torch and launched by
the driver directly; and the floor under the attention's Python: the decode
launch with its arguments packed once, straight into torch's static launcher.

    python benchmarks/profile_hop.py --out results/
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import triton
import triton.language as tl
from common import QWEN_05B, make_batch  # noqa: E402 (benchmarks/ is the script's folder)

import sgl_piecewise as sp
from sgl_piecewise.backends.triton_kernels import decode as dk
from sgl_piecewise.backends.triton_kernels.launch import FastLauncher
from sgl_piecewise.models import ModelConfig, build_random_model
from sgl_piecewise.ops.attention import attention_with_output_direct
from sgl_piecewise.runner import ModelRunner


@triton.jit
def _empty(a, b, c, d, e, f, g, h, i, j, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, BLOCK: tl.constexpr):
    pass


def per_call_us(fn, n: int = 3000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * seconds / n


def graph_launches() -> dict:
    """A small graph (eight pointwise kernels, like a piece of one layer)
    replayed through torch and launched by ``cuGraphLaunch`` directly."""
    import ctypes

    x = torch.randn(8, 896, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(8):
            y = y * 1.001
    rows = {"CUDAGraph.replay of an 8-kernel graph": graph.replay}
    raw_exec = getattr(graph, "raw_cuda_graph_exec", None)
    if raw_exec is not None:
        launch = ctypes.CDLL("libcuda.so.1").cuGraphLaunch
        launch.argtypes, launch.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
        handle = raw_exec()
        device = torch.cuda.current_device()
        rows["the same graph, cuGraphLaunch through ctypes"] = lambda: launch(
            handle, torch._C._cuda_getCurrentRawStream(device)
        )
    return rows


def packed_decode_launches(plan, q, k0, v0, k, v, out) -> dict:
    """The floor under the attention's Python: the plan's decode launch with
    its arguments packed once, straight into torch's static launcher (the
    stream looked up per call, as a launch must; and not even that)."""
    plan.launch(q, k0, v0, out, k, v, layer=0)  # keeps layer 0's launch, packed
    kept = plan._launch.kept_launch(0, (q, k0, v0, k, v, out))
    if kept is None or kept[1] is None:  # torch's static launcher does not apply
        return {}
    packed, launch = kept[1], plan._launch._kernel.static.launch_packed
    device = torch.cuda.current_device()
    stream = torch._C._cuda_getCurrentRawStream(device)
    return {
        "the decode launch, packed once, stream looked up": lambda: launch(
            *packed, torch._C._cuda_getCurrentRawStream(device)
        ),
        "the decode launch, packed once": lambda: launch(*packed, stream),
    }


def calls(runner, batch, ctx) -> dict:
    """What to time: name -> a call of it on the step's tensors (layer 0)."""
    config, pool, be = runner.config, runner.kv_pool, runner.backend
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = torch.randn(1, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, hkv, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    meta, scale, k0, v0 = be.forward_metadata, 1 / math.sqrt(d), pool.k_buffers[0], pool.v_buffers[0]
    loc = ctx.out_cache_loc
    step = (meta.kv_indptr, meta.kv_indices, meta.attn_logits, meta.attn_lse, meta.merge_counts, meta.num_kv_splits)
    decode = lambda: dk.decode_attention(  # noqa: E731
        q, k0, v0, out, *step, be.max_kv_splits, scale, new_k=k, new_v=v, out_cache_loc=loc, num_rows=1
    )
    plan = decode()
    empty_args = (q, k, v, out, q, k, v, out, q, k, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
    fast_empty = FastLauncher(_empty)
    fast_empty((1,), *empty_args, BLOCK=16)
    bound_empty = fast_empty.bound(empty_args, {"BLOCK": 16})
    empty_addresses = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in empty_args)
    return {
        **packed_decode_launches(plan, q, k0, v0, k, v, out),
        "attention op body (attention_with_output_direct)": lambda: attention_with_output_direct(q, k, v, out, 0),
        "backend.write_kv_and_attend (the step's DecodePlan)": lambda: be.write_kv_and_attend(
            q, k, v, out, 0, batch, scale, 1, loc
        ),
        "DecodePlan.launch (one layer: K/V write, splits, merge)": lambda: plan.launch(q, k0, v0, out, k, v),
        "decode_attention (checks, a new plan, its launch)": decode,
        "unfused path for comparison: pool.set_kv (2 index_copy_)": lambda: pool.set_kv(0, loc, k, v),
        "one index_copy_": lambda: k0.index_copy_(0, loc, k),
        "empty Triton kernel, 10 tensors + 10 ints (JITFunction.run)": lambda: _empty[(1,)](*empty_args, BLOCK=16),
        "empty Triton kernel through FastLauncher": lambda: fast_empty((1,), *empty_args, BLOCK=16),
        "empty Triton kernel, BoundKernel, addresses as ints": lambda: bound_empty((1,), *empty_addresses),
        "empty torch op (torch.empty(0))": lambda: torch.empty(0, device="cuda"),
        **graph_launches(),
        "out[1:].zero_() (no-op slice)": lambda: out[1:].zero_(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    config = ModelConfig.from_hf_dict(QWEN_05B)
    model = build_random_model(config, torch.bfloat16, "cuda", seed=0)
    runner = ModelRunner(model, max_reqs=8, max_context_len=1025, kv_cache_gib=2.0, backend="triton")
    batch = make_batch(runner, sp.ForwardMode.DECODE, [1023], [1])
    runner.backend.init_forward_metadata(batch)
    result = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d", time.gmtime()), "us_per_call": {}}  # fmt: skip
    with torch.no_grad(), sp.forward_context(batch, runner.backend) as ctx:
        for name, fn in calls(runner, batch, ctx).items():
            result["us_per_call"][name] = per_call_us(fn)
            print(f"{result['us_per_call'][name]:8.1f} us  {name}", flush=True)
    json.dump(result, open(os.path.join(args.out, "hop.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
