"""Prefetching a layer's weights into L2 on a side stream while its small
kernels run, in whole-model decode graphs (a script, not a test; tried and
not kept).

At decode batch sizes a layer's GEMMs read their weights from HBM while the
kernels between them (norms, rotary, attention) leave the memory bus mostly
idle. Could a side stream, forked inside the graph, pull the next GEMMs'
weights into L2 during those kernels? Two parts:

* ``gemm``: the bound. Each GEMM of layer 0 at 1 and 32 rows, µs per call in
  a CUDA graph of 24 calls: over 24 copies of its weight (``cold``: read
  from HBM) and over the same weight 24 times (``warm``: from L2).
* ``decode``: the suite shape's whole-model decode graphs
  (``CompiledModel(split_graph=False)``, triton attention, context 1024),
  captured once per plan with a custom op at three points of every layer
  (``layer``: before its input norm; ``attention``: before the attention
  call; ``after``: before the output projection) that forks a side stream
  and prefetches the plan's weights there; the stream joins before the final
  norm. Two ways to prefetch: ``asm`` (PTX ``prefetch.global.L2::evict_last``
  per 128-byte line) and ``load`` (loads with ``evict_last``, summed, never
  stored). Median graph replay, ms, in interleaved rounds, and each graph's
  largest logit difference to the graph without prefetches (must be 0).

    python benchmarks/bench_l2_prefetch.py --out results/ [--shape 1b]
"""

from __future__ import annotations

import argparse
import statistics
import types

import suite
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from common import free_batch, graph_step_fn, graph_us_per_layer, median_ms, write_json  # noqa: E402 (benchmarks/ is the script's folder)

from sgl_piecewise.compile import CompiledModel, CompileOptions
from sgl_piecewise.models import layers
from sgl_piecewise.runners import CudaGraphRunner
from sgl_piecewise.runners.whole_model import default_capture_sizes

POINTS = {"layer": 0, "attention": 1, "after": 2}
# Plans: point -> [(layer offset, weight, first fraction, last fraction)].
MLP_AND_O = [(0, "o", 0, 1), (0, "gate_up", 0, 1), (0, "down", 0, 1)]
PLANS = {
    "0.5b": {
        "layer: o, gate_up, down": {"layer": MLP_AND_O},
        "attention: o, gate_up, down": {"attention": MLP_AND_O},
        "after: next layer's qkv, o, gate_up, down": {
            "after": [(1, "qkv", 0, 1), (1, "o", 0, 1), (1, "gate_up", 0, 1), (1, "down", 0, 1)]
        },
    },
    "1b": {  # gate_up alone (67 MB) is larger than L2
        "layer: o, down": {"layer": [(0, "o", 0, 1), (0, "down", 0, 1)]},
        "attention: o, down": {"attention": [(0, "o", 0, 1), (0, "down", 0, 1)]},
        "layer: o, half of gate_up": {"layer": [(0, "o", 0, 1), (0, "gate_up", 0, 0.5)]},
    },
}
STATE = types.SimpleNamespace(plan=None, way="asm", stream=None, model=None, sink=None, flag=None)


@triton.jit
def _prefetch_lines(ptr, n_bytes, LINES: tl.constexpr):
    offs = (tl.program_id(0) * LINES + tl.arange(0, LINES)).to(tl.int64) * 128
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                              [ptr + tl.minimum(offs, n_bytes - 1)], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _load_evict_last(ptr, sink_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    total = tl.sum(tl.load(ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32))
    if total == 12345.678:  # never true: keeps the loads
        tl.store(sink_ptr, total)


def prefetch(weight: torch.Tensor, first: float, last: float) -> None:
    flat = weight.view(-1)
    flat = flat[int(flat.numel() * first) : int(flat.numel() * last)]
    if STATE.way == "asm":
        lines, as_bytes = 512, flat.view(torch.uint8)  # the kernel's offsets are in bytes
        n_bytes = as_bytes.numel()
        _prefetch_lines[(triton.cdiv(triton.cdiv(n_bytes, 128), lines),)](as_bytes, n_bytes, LINES=lines, num_warps=4)
    else:
        block = 8192
        _load_evict_last[(triton.cdiv(flat.numel(), block),)](flat, STATE.sink, flat.numel(), BLOCK=block, num_warps=8)


def weights(layer: int) -> dict:
    stack = STATE.model.model.layers
    if layer >= len(stack):
        return {}
    attn, mlp = stack[layer].self_attn, stack[layer].mlp
    return {"qkv": attn.qkv_proj.weight, "o": attn.o_proj.weight, "gate_up": mlp.gate_up_proj.weight,
            "down": mlp.down_proj.weight}  # fmt: skip


@torch.library.custom_op("sgl_piecewise_bench::prefetch", mutates_args=("flag",))
def prefetch_op(flag: torch.Tensor, point: int, layer: int) -> None:
    specs = (STATE.plan or {}).get(point, [])
    if not specs:
        return
    STATE.stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(STATE.stream):
        for offset, name, first, last in specs:
            weight = weights(layer + offset).get(name)
            if weight is not None:
                prefetch(weight, first, last)


@prefetch_op.register_fake
def _(flag, point, layer):
    return None


@torch.library.custom_op("sgl_piecewise_bench::join", mutates_args=("flag",))
def join_op(flag: torch.Tensor) -> None:
    if STATE.plan:
        torch.cuda.current_stream().wait_stream(STATE.stream)


@join_op.register_fake
def _(flag):
    return None


def layer_with_prefetches(self, positions, x, rotary):
    mark = lambda point: torch.ops.sgl_piecewise_bench.prefetch(STATE.flag, POINTS[point], self.self_attn.layer_id)  # noqa: E731
    mark("layer")
    attn = self.self_attn
    qk, v = attn.project_qkv(positions, self.input_layernorm(x), rotary)
    mark("attention")
    attn_out = attn.attend(qk, v)
    mark("after")
    x = x + attn.o_proj(attn_out)
    return x + self.mlp(self.post_attention_layernorm(x))


def model_with_join(self, input_ids, positions):
    x = self.embed_tokens(input_ids)
    for layer in self.layers:
        x = layer(positions, x, self.rotary_emb)
    torch.ops.sgl_piecewise_bench.join(STATE.flag)
    return self.norm(x)


def gemm_bound() -> dict:
    first = weights(0)
    result = {}
    for rows in (1, 32):
        for name, weight in first.items():
            x = torch.randn(rows, weight.shape[1], device="cuda", dtype=weight.dtype)
            copies = [weight.clone() for _ in range(24)]
            row = {}
            for label, seq in (("cold", copies), ("warm", [weight] * 24)):
                row[label] = graph_us_per_layer(lambda seq=seq, x=x: [F.linear(x, w) for w in seq], len(seq))
            result[f"{name}, {rows} rows"] = row
            print("gemm", name, rows, {k: round(v, 2) for k, v in row.items()}, flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", choices=sorted(PLANS), default="0.5b")
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 32])
    cli = p.parse_args()
    args = types.SimpleNamespace(shape=cli.shape, device="cuda", backend="triton", context=1024,
                                 decode_bs=cli.decode_bs, extend=[16])  # fmt: skip
    model, runner = suite.build(args)
    STATE.model, STATE.stream = model, torch.cuda.Stream()
    STATE.flag, STATE.sink = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    result = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": cli.shape,
              "gemm_us": gemm_bound()}  # fmt: skip
    layers.DecoderLayer.forward = layer_with_prefetches
    type(model.model).forward = model_with_join
    compiled = CompiledModel(model, CompileOptions(split_graph=False))
    graphs = {}
    for way in ("asm", "load"):
        for name, plan in {"none": None, **PLANS[cli.shape]}.items():
            if plan is None and graphs:
                continue
            STATE.plan, STATE.way = plan and {POINTS[k]: v for k, v in plan.items()}, way
            runner_graphs = CudaGraphRunner(runner, default_capture_sizes(max(cli.decode_bs)), forward=compiled)
            runner_graphs.capture(progress=False)
            graphs["none" if plan is None else f"{way}: {name}"] = runner_graphs
    runner.step_graphs = None
    result["decode_ms"] = {}
    with torch.no_grad():
        for bs in cli.decode_bs:
            batch = suite.step_batch(args, runner, "decode", bs)
            ref = graph_step_fn(runner, graphs["none"], batch)()
            diffs = {k: float((graph_step_fn(runner, g, batch)() - ref).abs().max()) for k, g in graphs.items()}
            replays = {k: g.captured_graph(batch.forward_mode, g.padded_bs(batch)).replay for k, g in graphs.items()}
            samples = {k: [] for k in graphs}
            for _ in range(5):
                for k, replay in replays.items():
                    samples[k].append(median_ms(replay, 3, 20))
            result["decode_ms"][bs] = {
                k: {"replay": statistics.median(v), "maxdiff": diffs[k]} for k, v in samples.items()
            }
            for k, row in result["decode_ms"][bs].items():
                print(f"bs {bs:3d} {k:45s} {row['replay']:.4f} ms  diff {row['maxdiff']}", flush=True)
            free_batch(runner, batch)
    print("wrote", write_json(cli.out, f"l2_prefetch_{cli.shape}.json", result))


if __name__ == "__main__":
    main()
