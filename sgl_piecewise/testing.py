"""Builders of random ragged batches over real pools, for tests, ``verify``
and benchmarks. Nothing here is a stand-in: the batch is laid out in the pools
exactly as ``ModelRunner`` lays out a real one."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from sgl_piecewise.forward import ForwardBatch, ForwardMode, SpecInfo
from sgl_piecewise.memory import KVPool, ReqToTokenPool


def place_requests(
    req_pool: ReqToTokenPool,
    kv_pool: KVPool,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    *,
    fill_prefix: bool = True,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate rows and slots for requests; return ``(req_pool_indices, out_cache_loc)``.

    With ``fill_prefix`` the prefix slots of every layer get random K/V, as if
    earlier steps had written them.
    """
    rows = req_pool.alloc(len(prefix_lens))
    new_slots: List[torch.Tensor] = []
    for row, p, e in zip(rows, prefix_lens, extend_lens):
        slots = kv_pool.alloc(p + e)
        req_pool.write(row, 0, slots)
        if fill_prefix and p:
            for layer in range(kv_pool.num_layers):
                shape = (p, kv_pool.num_kv_heads, kv_pool.head_dim)
                k = torch.randn(shape, generator=generator).to(kv_pool.device, kv_pool.dtype)
                v = torch.randn(shape, generator=generator).to(kv_pool.device, kv_pool.dtype)
                kv_pool.set_kv(layer, slots[:p], k, v)
        new_slots.append(slots[p:])
    device = kv_pool.device
    loc = torch.cat(new_slots) if new_slots else torch.empty(0, dtype=torch.int64, device=device)
    return torch.tensor(rows, dtype=torch.int64, device=device), loc


def random_batch(
    mode: ForwardMode,
    req_pool: ReqToTokenPool,
    kv_pool: KVPool,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    *,
    vocab_size: int = 128,
    spec_info: Optional[SpecInfo] = None,
    generator: Optional[torch.Generator] = None,
) -> ForwardBatch:
    """A batch of random token ids whose prefixes hold random K/V in the pool."""
    rows, loc = place_requests(req_pool, kv_pool, prefix_lens, extend_lens, generator=generator)
    n = sum(extend_lens)
    ids = torch.randint(0, vocab_size, (n,), generator=generator).to(kv_pool.device)
    return ForwardBatch.build(mode, ids, rows, list(prefix_lens), list(extend_lens), loc, spec_info)
