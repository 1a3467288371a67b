"""Builders of random ragged batches over real pools, for tests, ``verify``
and benchmarks, and the smallest model configuration tests compile. Nothing
here is a stand-in: the batch is laid out in the pools exactly as
``ModelRunner`` lays out a real one."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from sgl_piecewise.backends.reference import ReferenceBackend
from sgl_piecewise.context import forward_context
from sgl_piecewise.forward import ForwardBatch, ForwardMode, SpecInfo
from sgl_piecewise.memory import KVPool, ReqToTokenPool, allocate_requests
from sgl_piecewise.models.config import ModelConfig


def two_layer_llama_config() -> ModelConfig:
    """Two Llama layers of hidden size 64, 4 query and 2 KV heads of 16 dims,
    vocabulary 256: a model that compiles in seconds on a CPU."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
    )


def place_requests(
    req_pool: ReqToTokenPool,
    kv_pool: KVPool,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    *,
    fill_prefix: bool = True,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``memory.allocate_requests``, then (with ``fill_prefix``) random K/V in
    every layer's prefix slots, as if earlier steps had written them."""
    rows, loc = allocate_requests(req_pool, kv_pool, prefix_lens, extend_lens)
    if fill_prefix:
        table = req_pool.req_to_token
        for row, p in zip(rows.tolist(), prefix_lens):
            if not p:
                continue
            slots = table[row, :p].to(torch.int64)
            for layer in range(kv_pool.num_layers):
                shape = (p, kv_pool.num_kv_heads, kv_pool.head_dim)
                k = torch.randn(shape, generator=generator).to(kv_pool.device, kv_pool.dtype)
                v = torch.randn(shape, generator=generator).to(kv_pool.device, kv_pool.dtype)
                kv_pool.set_kv(layer, slots, k, v)
    return rows, loc


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


def release_batch(req_pool: ReqToTokenPool, kv_pool: KVPool, batch: ForwardBatch) -> None:
    """Free every request row of ``batch`` and every KV slot its requests hold
    (prefix and new tokens: ``seq_lens`` of each, or prefix + new for the
    modes whose ``seq_lens`` exclude the new tokens)."""
    rows = batch.req_pool_indices.tolist()
    held = (batch.seq_lens_cpu + batch.extend_seq_lens.cpu()
            if batch.forward_mode.seq_lens_exclude_new_tokens() else batch.seq_lens_cpu)  # fmt: skip
    table = req_pool.req_to_token
    slots = [table[r, : int(n)] for r, n in zip(rows, held.tolist()) if n]
    if slots:
        kv_pool.free(torch.cat(slots).to(torch.int64))
    req_pool.free(rows)


def prefill_logits(model: torch.nn.Module, prompt: Sequence[int]) -> torch.Tensor:
    """``[len(prompt), vocab]`` float32 logits of one eager EXTEND step over
    ``prompt`` (reference attention, pools of its own): the plain forward a
    loaded model's outputs are compared with."""
    cfg = model.config
    param = next(model.parameters())
    device = param.device
    req_pool = ReqToTokenPool(max_reqs=1, max_context_len=len(prompt), device=device)
    kv_pool = KVPool(
        len(prompt), cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype=param.dtype, device=device
    )
    backend = ReferenceBackend(req_pool, kv_pool)
    rows, loc = place_requests(req_pool, kv_pool, [0], [len(prompt)], fill_prefix=False)
    ids = torch.tensor(list(prompt), dtype=torch.int64, device=device)
    batch = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, [0], [len(prompt)], loc)
    backend.init_forward_metadata(batch)
    with torch.no_grad(), forward_context(batch, backend):
        return model.compute_logits(model(batch.input_ids, batch.positions))
