"""Decode-attention kernel benchmark (a script, not a test): our Triton
split-KV kernel over the paged pool, as achieved bandwidth against the card's
copy rate, with PyTorch's SDPA over contiguous per-request K/V as a yardstick
(FlashInfer, the issue's yardstick, is not installed on the lent GPU).

    python benchmarks/bench_decode_kernel.py --out results/

Shape: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128), bf16,
batch 1 / 32 / 128, context 1k / 4k / 16k, slots shuffled through the pool.
Bytes = the K and V rows read (bs * ctx * Hkv * D * 2 * 2) + q and out.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from bench_steps import copy_rate, cuda_median_ms
from sgl_piecewise.backends.lengths import cumsum_with_zero
from sgl_piecewise.backends.triton_kernels import DEFAULT_MAX_KV_SPLITS, choose_num_kv_splits, decode_attention

HQ, HKV, D = 32, 8, 128


def one_point(bs: int, ctx: int, max_splits: int) -> dict:
    slots = bs * ctx
    k_cache = torch.randn(slots + 1, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    kv_indices = (torch.randperm(slots, device="cuda") + 1).to(torch.int32)
    kv_lens = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")
    kv_indptr = cumsum_with_zero(kv_lens)
    q = torch.randn(bs, HQ, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    logits = torch.empty(bs, HQ, max_splits, D, device="cuda", dtype=torch.float32)
    lse = torch.empty(bs, HQ, max_splits, device="cuda", dtype=torch.float32)
    splits = choose_num_kv_splits(kv_lens, max_splits, torch.empty_like(kv_lens))
    scale = D**-0.5

    def ours():
        decode_attention(q, k_cache, v_cache, out, kv_indptr, kv_indices, logits, lse, splits, max_splits, scale)

    # Yardstick: SDPA over the same keys laid out contiguously per request.
    order = kv_indices.long().view(bs, ctx)
    k_req = k_cache[order].transpose(1, 2).contiguous()  # [bs, Hkv, ctx, D]
    v_req = v_cache[order].transpose(1, 2).contiguous()
    q4 = q.unsqueeze(2)  # [bs, Hq, 1, D]

    def sdpa():
        return F.scaled_dot_product_attention(q4, k_req, v_req, scale=scale, enable_gqa=True)

    ms_ours = cuda_median_ms(ours, 5, 50)
    ms_sdpa = cuda_median_ms(sdpa, 5, 50)
    err = (out.float() - sdpa().squeeze(2).float()).abs().max().item()
    nbytes = 2 * bs * ctx * HKV * D * 2 + 2 * q.numel() * 2
    return {"bs": bs, "ctx": ctx, "ours_ms": ms_ours, "sdpa_ms": ms_sdpa,
            "ours_graph_ms": graph_ms(ours), "sdpa_graph_ms": graph_ms(sdpa),
            "bytes": nbytes, "max_abs_err": err}  # fmt: skip


def graph_ms(fn) -> float:
    """Device time of ``fn`` without Python launch gaps: replays of a graph of it."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_median_ms(graph.replay, 5, 50)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-kv-splits", type=int, default=DEFAULT_MAX_KV_SPLITS)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rate = copy_rate()
    rows = []
    for bs in (1, 32, 128):
        for ctx in (1024, 4096, 16384):
            r = one_point(bs, ctx, args.max_kv_splits)
            for name in ("ours_ms", "sdpa_ms", "ours_graph_ms", "sdpa_graph_ms"):
                r[name.replace("_ms", "_frac_of_copy_rate")] = r["bytes"] / (r[name] / 1e3) / rate
            rows.append(r)
            print(json.dumps(r), flush=True)
            torch.cuda.empty_cache()
    info = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_rate_Bps": rate,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}  # fmt: skip
    json.dump(info, open(os.path.join(args.out, "decode_kernel.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
