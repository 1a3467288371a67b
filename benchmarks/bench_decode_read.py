"""How fast can a decode step read its keys and values from the paged pool?
(a script, not a test).

The decode kernel gives each program one kv head of one request's split
of keys. With head_dim 64 that is 128 bytes of every slot's 256 (0.5b, two
kv heads) or 1,024 (1b, eight). This times two read-only kernels over the
same slots, with the decode kernel's grid rule (``grid_kv_splits``) and
8 KB tiles (64 keys of one head), and nothing else (a sum of what they load, stored once per
program):

* ``per_head``: one program per (request, kv head, split), the decode
  kernel's grid;
* ``all_heads``: one program per (request, split) reads whole slots, every
  kv head, with as many programs as ``per_head`` (the splits multiplied by
  the kv heads), or with as many splits (fewer, longer programs).

µs per layer (one CUDA graph over the model's layers, each with its own
pool, contiguous slots per request as the suite places them), against the
copy-rate floor of the K/V bytes. The whole decode kernel's own figures are
in docs/BENCHMARKS.md.

    python benchmarks/bench_decode_read.py --out results/
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from common import card_info, copy_rate, graph_us_per_layer, measure_rows, write_json  # noqa: E402 (benchmarks/ is the script's folder)

from sgl_piecewise.backends.triton_kernels.decode import grid_kv_splits

# name: (query heads, kv heads, head_dim, layers)
SHAPES = {"0.5b": (14, 2, 64, 24), "1b": (32, 8, 64, 16)}
# Keys a tile: the decode kernel's 64 for one head of 64 values; whole slots
# take fewer keys a tile, so every variant loads 8 KB of K (and of V) a tile.
TILE_VALUES = 64 * 64


@triton.jit
def _read_kernel(k_ptr, v_ptr, indptr_ptr, indices_ptr, out_ptr, stride_slot, SPLITS: tl.constexpr,
                 HEADS_PER_PROGRAM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Sum of the K and V rows of keys ``[start, end)`` of one request's
    split, over ``HEADS_PER_PROGRAM`` kv heads from head ``program_id(1)``."""
    req, head_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first = tl.load(indptr_ptr + req)
    kv_len = tl.load(indptr_ptr + req + 1) - first
    per_split = tl.cdiv(tl.cdiv(kv_len, SPLITS), 32) * 32
    start = split * per_split
    end = tl.minimum(start + per_split, kv_len)
    cols = head_block * HEADS_PER_PROGRAM * HEAD_DIM + tl.arange(0, HEADS_PER_PROGRAM * HEAD_DIM)
    offs = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, HEADS_PER_PROGRAM * HEAD_DIM], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        mask = n0 + offs < end
        slots = tl.load(indices_ptr + first + n0 + offs, mask=mask, other=0).to(tl.int64)
        rows = slots[:, None] * stride_slot + cols[None, :]
        acc += tl.load(k_ptr + rows, mask=mask[:, None], other=0.0).to(tl.float32)
        acc += tl.load(v_ptr + rows, mask=mask[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + (req * tl.num_programs(1) + head_block) * SPLITS + split, tl.sum(tl.sum(acc, 1), 0))


def read(k, v, indptr, indices, out, bs, kv_heads, splits, heads_per_program) -> None:
    head_dim = k.shape[2]
    block_n = max(16, TILE_VALUES // (heads_per_program * head_dim))
    _read_kernel[(bs, kv_heads // heads_per_program, splits)](
        k, v, indptr, indices, out, k.stride(0), SPLITS=splits, HEADS_PER_PROGRAM=heads_per_program,
        HEAD_DIM=head_dim, BLOCK_N=block_n, num_warps=4, num_stages=3,
    )  # fmt: skip


def measure(shape: str, bs: int, context: int, rate: float) -> dict:
    q_heads, kv_heads, head_dim, layers = SHAPES[shape]
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    slots = bs * context
    pools = [(torch.randn(slots + 1, kv_heads, head_dim, device=dev, dtype=bf16),
              torch.randn(slots + 1, kv_heads, head_dim, device=dev, dtype=bf16)) for _ in range(layers)]  # fmt: skip
    indptr = torch.arange(0, slots + 1, context, device=dev, dtype=torch.int32)
    indices = torch.arange(1, slots + 1, device=dev, dtype=torch.int32)  # contiguous per request
    splits = grid_kv_splits(bs, q_heads, kv_heads, bf16, 64, dev, head_dim=head_dim)
    out = torch.empty(bs * kv_heads * splits * kv_heads, device=dev)
    kv_bytes = 2 * slots * kv_heads * head_dim * 2
    row = dict(shape=shape, bs=bs, context=context, grid_splits=splits, floor_us=1e6 * kv_bytes / rate)
    variants = {
        "per_head": (splits, 1),
        "all_heads_same_programs": (splits * kv_heads, kv_heads),
        "all_heads_same_splits": (splits, kv_heads),
    }
    for name, (s, per) in variants.items():
        row[name + "_us"] = graph_us_per_layer(
            lambda s=s, per=per: [read(k, v, indptr, indices, out, bs, kv_heads, s, per) for k, v in pools], layers
        )
    # The sums agree across variants (same bytes read), up to float order.
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for bench_decode_read.json")
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=1024)
    args = p.parse_args()
    rate = copy_rate()
    rows = measure_rows(lambda shape, bs: measure(shape, bs, args.context, rate), SHAPES, args.decode_bs)
    info = card_info(copy_rate_Bps=rate, rows=rows)
    write_json(args.out, "bench_decode_read.json", info)


if __name__ == "__main__":
    main()
