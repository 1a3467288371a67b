"""Triton's own launcher against torch's static CUDA launcher, for one of
our kernels' kind of argument list (a script, not a test).

A kernel of 10 pointers, 6 integers and 2 constexprs, compiled once per
process with ``JITFunction.warmup`` (no launch). Measured:

* ``triton_launcher_build_s``: the first use of Triton's launcher for the
  compiled kernel, which generates its C launcher and builds it with the
  host's C compiler (run with an empty ``TRITON_CACHE_DIR``: a cached
  launcher is only loaded);
* ``static_load_s``: ``static_launch.static_kernel`` for the same
  signature: the cubin loaded for torch's launcher, nothing built;
* ``launch_us``: host µs per launch through ``launch.BoundKernel``, pointers
  given as device addresses, median of 2000, each launcher timed twice in
  alternation: ``triton`` (the kernel's own launcher) and ``static``.

Both launches must write the same values (checked).

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/bench_static_launch.py --out results/
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


@triton.jit
def _sixteen_args(a, b, c, d, e, f, g, h, i, out, n, s1, s2, s3, s4, s5, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(a + offs, mask=m) + tl.load(b + offs, mask=m) * s1 + s2 + s3 + s4 + s5
    tl.store(out + offs, v + SHIFT, mask=m)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    tensors = [torch.zeros(1024, device="cuda") for _ in range(10)]
    ints = (1000, 3, 5, 7, 9, 11)  # none equal to 1 or divisible by 16: all stay arguments
    meta = dict(BLOCK=128, SHIFT=2)
    kernel = _sixteen_args.warmup(*tensors, *ints, grid=(8,), **meta)
    result = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d", time.gmtime())}  # fmt: skip
    start = time.perf_counter()
    kernel.run  # noqa: B018 (the attribute's first use builds the launcher)
    result["triton_launcher_build_s"] = time.perf_counter() - start
    start = time.perf_counter()
    static = static_kernel(kernel, len(tensors) + len(ints), torch.cuda.current_device())
    result["static_load_s"] = time.perf_counter() - start
    if static is None:
        raise SystemExit("torch's static launcher does not apply here (static_launch.py says when)")
    constexprs = tuple(meta.values())
    through = {"triton": BoundKernel(kernel, constexprs), "static": BoundKernel(kernel, constexprs, static)}
    addresses = [t.data_ptr() for t in tensors]
    outputs = {}
    for name, bound in through.items():
        tensors[-1].zero_()
        bound((8,), *addresses, *ints)
        outputs[name] = tensors[-1].clone()
    if not torch.equal(outputs["triton"], outputs["static"]):
        raise SystemExit("the two launchers wrote different values")
    result["launch_us"] = {name: [] for name in through}
    for _ in range(2):
        for name, bound in through.items():
            launch = lambda b=bound: b((8,), *addresses, *ints)  # noqa: E731
            result["launch_us"][name].append(1e3 * host_ms(launch, reps=2000, warmup=100, sync_each=False))
    print(result)
    print("wrote", write_json(args.out, "static_launch.json", result))


if __name__ == "__main__":
    main()
