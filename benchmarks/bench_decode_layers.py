"""The decode attention kernel as a model's step launches it (a script, not
a test).

For the attention of the suite's shapes (0.5b: 14 query / 2 KV heads, 1b:
32 / 8, head_dim 64; ``--shapes llama3-8b``: 32 / 8, head_dim 128), bf16,
every request with ``--context`` keys: one CUDA graph of one launch per
layer (24 layers for 0.5b, 16 for 1b, 32 for llama3-8b), each layer
with its own K/V pool, the new tokens' K/V written by the launch as between
pieces and in the whole-model graph. Each figure is the median of 40
replays divided by the layers: µs of device time per layer, at each decode
batch size, each ``tokens_per_split`` (keys per split before another is
added, ``choose_num_kv_splits``) and each launch setting (``--launch``:
keys per tile / warps / pipeline stages / programs per SM the split axis
fills or ``auto``, and optionally / splits the merge loads at once,
``DecodeLaunch``; default: the kernel's own).

    python benchmarks/bench_decode_layers.py --out results/
    python benchmarks/bench_decode_layers.py --out results/ --launch 64/4/3/auto 64/4/3/2 64/4/3/4
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Callable

import torch
from common import graph_us_per_layer, write_json  # noqa: E402 (benchmarks/ is the script's folder)

from sgl_piecewise.backends.triton_kernels.decode import (
    DEFAULT_DECODE_LAUNCH,
    DecodeLaunch,
    choose_num_kv_splits,
    decode_attention,
)

# name: (query heads, kv heads, head_dim, layers); llama3-8b: Llama-3-8B's
# attention, the shape the kernel's launch was first tuned on.
SHAPES = {"0.5b": (14, 2, 64, 24), "1b": (32, 8, 64, 16), "llama3-8b": (32, 8, 128, 32)}
MAX_KV_SPLITS = 64


def parse_launch(text: str) -> DecodeLaunch:
    """``"64/4/3/2"`` -> DecodeLaunch(block_n=64, num_warps=4, num_stages=3, programs_per_sm=2);
    ``"64/4/3/auto"``: programs_per_sm=None (the kernel's default_programs_per_sm);
    a fifth field sets merge_splits (``"64/4/3/auto/2"``)."""
    parts = text.split("/")
    ok = len(parts) in (4, 5) and all(p.isdigit() for p in parts[:3] + parts[4:])
    if not ok or not (parts[3].isdigit() or parts[3] == "auto"):
        raise argparse.ArgumentTypeError(
            f"expected block_n/num_warps/num_stages/programs_per_sm|auto[/merge_splits], got {text!r}"
        )
    block_n, warps, stages = map(int, parts[:3])
    per_sm = None if parts[3] == "auto" else int(parts[3])
    merge = int(parts[4]) if len(parts) == 5 else None
    return DecodeLaunch(block_n=block_n, num_warps=warps, num_stages=stages, programs_per_sm=per_sm,
                        merge_splits=merge)  # fmt: skip


def launch_name(launch: DecodeLaunch) -> str:
    per_sm = "auto" if launch.programs_per_sm is None else launch.programs_per_sm
    merge = "" if launch.merge_splits is None else f"/{launch.merge_splits}"
    return f"{launch.block_n}/{launch.num_warps}/{launch.num_stages}/{per_sm}{merge}"


def step_launches(hq: int, hkv: int, d: int, layers: int, bs: int, context: int, tokens_per_split: int,
                  launch: DecodeLaunch) -> Callable:  # fmt: skip
    """One step's decode launches, a layer each, over random pools and a shuffled page table."""
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    slots = bs * context + 8
    k_pools = [torch.randn(slots, hkv, d, device=dev, dtype=bf16) for _ in range(layers)]
    v_pools = [torch.randn(slots, hkv, d, device=dev, dtype=bf16) for _ in range(layers)]
    kv_indices = torch.randperm(slots - 8, device=dev)[: bs * context].to(torch.int32) + 1
    kv_indptr = torch.arange(0, bs * context + 1, context, device=dev, dtype=torch.int32)
    new_slots = torch.empty(bs, dtype=torch.int64, device=dev).copy_(kv_indices.view(bs, context)[:, -1])
    q = torch.randn(bs, hq, d, device=dev, dtype=bf16)
    new_k, new_v = (torch.randn(bs, hkv, d, device=dev, dtype=bf16) for _ in range(2))
    out = torch.empty(bs, hq, d, device=dev, dtype=bf16)
    kv_lens = torch.full((bs,), context, device=dev, dtype=torch.int32)
    splits = choose_num_kv_splits(kv_lens, MAX_KV_SPLITS, torch.empty_like(kv_lens), tokens_per_split)
    scratch = (
        torch.empty(bs, hq, MAX_KV_SPLITS, d, device=dev),
        torch.empty(bs, hq, MAX_KV_SPLITS, device=dev),
        torch.zeros(bs, hq, dtype=torch.int32, device=dev),
    )

    def run() -> None:
        for k_pool, v_pool in zip(k_pools, v_pools):
            decode_attention(q, k_pool, v_pool, out, kv_indptr, kv_indices, *scratch, splits, MAX_KV_SPLITS,
                             d**-0.5, launch, new_k=new_k, new_v=new_v, out_cache_loc=new_slots)  # fmt: skip

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for bench_decode_layers.json")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["0.5b", "1b"])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--tokens-per-split", type=int, nargs="+", default=[32, 64, 128])
    launch_help = "block_n/num_warps/num_stages/programs_per_sm|auto[/merge_splits]; default: the kernel's"
    p.add_argument("--launch", type=parse_launch, nargs="+", default=[DEFAULT_DECODE_LAUNCH], help=launch_help)
    args = p.parse_args()
    rows = []
    for shape in args.shapes:
        hq, hkv, d, layers = SHAPES[shape]
        for bs in args.decode_bs:
            for tps, launch in itertools.product(args.tokens_per_split, args.launch):
                run = step_launches(hq, hkv, d, layers, bs, args.context, tps, launch)
                row = dict(shape=shape, bs=bs, context=args.context, tokens_per_split=tps,
                           launch=launch_name(launch), us_per_layer=graph_us_per_layer(run, layers))  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
    info = dict(card=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows=rows)
    write_json(args.out, "bench_decode_layers.json", info)


if __name__ == "__main__":
    main()
