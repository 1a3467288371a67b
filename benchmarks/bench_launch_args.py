"""What a kernel's argument count costs the host at launch (a script, not a
test).

The attention between compiled pieces launches one kernel per layer; on the
H100 and H200 hosts measured, that launch takes 9-13 µs of host time, twice
a piece's graph launch. Our decode kernel takes 36 runtime arguments (13
pointers, 23 integers and a float: strides, sizes, the scale), which
Triton's and torch's launchers pack one by one and the driver copies into
its launch. This times kernels that differ only in how many integer
arguments they take (4 pointers plus 4, 12, 20 or 32 integers), each
through ``launch.BoundKernel`` as the attention launches its kernels:
torch's static launcher, pointers given as device addresses.
``launch_us[n]``: host µs per launch of the ``n``-argument kernel, median
of 2000 launches back to back, every kernel timed three times in rotation.
For scale, ``graph_launch_us``: ``CUDAGraph.replay`` of a graph of one
such kernel, and ``torch_op_us``: an in-place add on a one-element tensor.

Every launch must write what the kernel computes (checked).

    python benchmarks/bench_launch_args.py --out results/
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl
from common import host_ms, write_json  # noqa: E402 (benchmarks/ is the script's folder)

from sgl_piecewise.backends.triton_kernels.launch import BoundKernel
from sgl_piecewise.backends.triton_kernels.static_launch import static_kernel

# Integer arguments: odd and above 16, so Triton specialises none of them
# away (it does so for 1 and notes multiples of 16).
_VALUES = tuple(range(17, 17 + 2 * 32, 2))


@triton.jit
def _ints_4(a, b, c, out, i0, i1, i2, i3, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    s = i0 + i1 + i2 + i3
    tl.store(out + offs, tl.load(a + offs) + tl.load(b + offs) + tl.load(c + offs) + s)


@triton.jit
def _ints_12(a, b, c, out, i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    s = i0 + i1 + i2 + i3 + i4 + i5 + i6 + i7 + i8 + i9 + i10 + i11
    tl.store(out + offs, tl.load(a + offs) + tl.load(b + offs) + tl.load(c + offs) + s)


@triton.jit
def _ints_20(a, b, c, out, i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12, i13, i14, i15, i16, i17, i18,
             i19, BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, BLOCK)
    s = i0 + i1 + i2 + i3 + i4 + i5 + i6 + i7 + i8 + i9 + i10 + i11 + i12 + i13 + i14 + i15 + i16 + i17 + i18 + i19
    tl.store(out + offs, tl.load(a + offs) + tl.load(b + offs) + tl.load(c + offs) + s)


@triton.jit
def _ints_32(a, b, c, out, i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12, i13, i14, i15, i16, i17, i18,
             i19, i20, i21, i22, i23, i24, i25, i26, i27, i28, i29, i30, i31, BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, BLOCK)
    s = (i0 + i1 + i2 + i3 + i4 + i5 + i6 + i7 + i8 + i9 + i10 + i11 + i12 + i13 + i14 + i15 + i16 + i17 + i18
         + i19 + i20 + i21 + i22 + i23 + i24 + i25 + i26 + i27 + i28 + i29 + i30 + i31)  # fmt: skip
    tl.store(out + offs, tl.load(a + offs) + tl.load(b + offs) + tl.load(c + offs) + s)


KERNELS = {4: _ints_4, 12: _ints_12, 20: _ints_20, 32: _ints_32}
BLOCK = 128


def bound_kernel(fn, tensors, ints) -> BoundKernel:
    """``fn`` compiled for these arguments (no launch) and loaded for
    torch's static launcher, as the attention's launches are."""
    compiled = fn.warmup(*tensors, *ints, grid=(1,), BLOCK=BLOCK)
    num_args = len(tensors) + len(ints)
    static = static_kernel(compiled, num_args, torch.cuda.current_device())
    if static is None:
        raise SystemExit("torch's static launcher does not apply here (static_launch.py says when)")
    return BoundKernel(compiled, (BLOCK,), static)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    tensors = [torch.full((BLOCK,), float(i), device="cuda") for i in range(4)]
    addresses = [t.data_ptr() for t in tensors]
    launches = {}
    for n, fn in KERNELS.items():
        ints = _VALUES[:n]
        bound = bound_kernel(fn, tensors, ints)
        tensors[-1].zero_()
        bound((1,), *addresses, *ints)
        expected = torch.full((BLOCK,), 0.0 + 1.0 + 2.0 + sum(ints), device="cuda")
        if not torch.equal(tensors[-1], expected):
            raise SystemExit(f"the {n}-integer kernel wrote {tensors[-1][:4].tolist()}, expected {sum(ints) + 3.0}")
        launches[len(tensors) + n] = lambda b=bound, i=ints: b((1,), *addresses, *i)

    graph = torch.cuda.CUDAGraph()
    smallest = next(iter(launches.values()))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        smallest()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        smallest()
    one = torch.zeros(1, device="cuda")

    result = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "reps": args.reps,
              "launch_us": {n: [] for n in launches}, "graph_launch_us": [], "torch_op_us": []}  # fmt: skip
    timed = dict(launches, graph=graph.replay, torch_op=lambda: one.add_(1.0))
    for _ in range(args.rounds):
        for name, run in timed.items():
            us = 1e3 * host_ms(run, reps=args.reps, warmup=100, sync_each=False)
            if name == "graph":
                result["graph_launch_us"].append(us)
            elif name == "torch_op":
                result["torch_op_us"].append(us)
            else:
                result["launch_us"][name].append(us)
    print(result)
    print("wrote", write_json(args.out, "launch_args.json", result))


if __name__ == "__main__":
    main()
