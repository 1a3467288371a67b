"""Random ragged batches laid out in real pools as ``ModelRunner`` lays them
out, for tests, ``verify`` and benchmarks."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from sgl_piecewise.backends.base import AttentionBackend
from sgl_piecewise.backends.reference import ReferenceBackend
from sgl_piecewise.batch_checks import check_batch
from sgl_piecewise.context import forward_context
from sgl_piecewise.engine.runner import attention_heads
from sgl_piecewise.forward import ForwardBatch, ForwardMode, SpecInfo
from sgl_piecewise.memory import KVPool, ReqToTokenPool, allocate_requests
from sgl_piecewise.models.config import ModelConfig
from sgl_piecewise.runners.eager import run_model


def two_layer_llama_config() -> ModelConfig:
    """A two-layer Llama small enough to compile quickly on a CPU."""
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


def model_written_batch(
    mode: ForwardMode,
    req_pool: ReqToTokenPool,
    kv_pool: KVPool,
    model: torch.nn.Module,
    backend: AttentionBackend,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    *,
    vocab_size: int = 128,
    spec_info: Optional[SpecInfo] = None,
    generator: Optional[torch.Generator] = None,
) -> ForwardBatch:
    """A batch of random token ids whose prefixes hold the K/V one eager EXTEND
    of ``model`` writes for random prefix tokens: unlike random K/V, in the
    range a trained model's attention expects, and bit-identical on every
    runner for the same generator state. Release it with ``release_batch``.
    """
    rows, loc = place_requests(req_pool, kv_pool, prefix_lens, extend_lens, fill_prefix=False)
    try:
        prefix_ids = torch.randint(0, vocab_size, (sum(prefix_lens),), generator=generator)
        _prefill_prefixes(req_pool, kv_pool, model, backend, rows, list(prefix_lens), prefix_ids)
        ids = torch.randint(0, vocab_size, (sum(extend_lens),), generator=generator).to(kv_pool.device)
        return ForwardBatch.build(mode, ids, rows, list(prefix_lens), list(extend_lens), loc, spec_info)
    except BaseException:
        kv_pool.free(req_pool.mapped_slots(rows.tolist()))
        req_pool.free(rows.tolist())
        raise


def _prefill_prefixes(
    req_pool: ReqToTokenPool,
    kv_pool: KVPool,
    model: torch.nn.Module,
    backend: AttentionBackend,
    rows: torch.Tensor,
    prefix_lens: Sequence[int],
    prefix_ids: torch.Tensor,
) -> None:
    """One eager EXTEND over the requests' prefix tokens, into their prefix slots."""
    held = [(row, p) for row, p in zip(rows.tolist(), prefix_lens) if p]
    if not held:
        return
    table = req_pool.req_to_token
    loc = torch.cat([table[row, :p] for row, p in held]).to("cpu", torch.int64)
    lens = [p for _, p in held]
    sub_rows = torch.tensor([row for row, _ in held], dtype=torch.int64)
    batch = ForwardBatch.build(ForwardMode.EXTEND, prefix_ids.to(kv_pool.device), sub_rows, [0] * len(held), lens, loc)
    check_batch(batch, req_pool, kv_pool)
    with torch.no_grad():
        run_model(model, batch, backend)


def release_batch(req_pool: ReqToTokenPool, kv_pool: KVPool, batch: ForwardBatch) -> None:
    """Free every request row of ``batch`` and every KV slot its requests hold."""
    rows = batch.req_pool_indices.tolist()
    held = (
        batch.seq_lens_cpu + batch.extend_seq_lens.cpu()
        if batch.forward_mode.seq_lens_exclude_new_tokens()
        else batch.seq_lens_cpu
    )
    table = req_pool.req_to_token
    slots = [table[r, : int(n)] for r, n in zip(rows, held.tolist()) if n]
    if slots:
        kv_pool.free(torch.cat(slots).to(torch.int64))
    req_pool.free(rows)


def prefill_logits(model: torch.nn.Module, prompt: Sequence[int]) -> torch.Tensor:
    """``[len(prompt), vocab]`` float32 logits of one eager EXTEND step over
    ``prompt`` (reference attention, pools of its own)."""
    cfg = model.config
    param = next(model.parameters())
    device = param.device
    req_pool = ReqToTokenPool(max_reqs=1, max_context_len=len(prompt), device=device)
    _, kv_heads = attention_heads(model)
    kv_pool = KVPool(len(prompt), cfg.num_hidden_layers, kv_heads, cfg.head_dim, dtype=param.dtype, device=device)
    backend = ReferenceBackend(req_pool, kv_pool)
    rows, loc = place_requests(req_pool, kv_pool, [0], [len(prompt)], fill_prefix=False)
    ids = torch.tensor(list(prompt), dtype=torch.int64, device=device)
    batch = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, [0], [len(prompt)], loc)
    backend.init_forward_metadata(batch)
    with torch.no_grad(), forward_context(batch, backend):
        return model.compute_logits(model(batch.input_ids, batch.positions))
