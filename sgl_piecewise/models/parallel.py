"""Tensor parallelism of the Llama-family models (Megatron-style): what rank
``r`` of ``N`` holds of each weight. Column-parallel (q, k, v, gate, up):
output rows, ``heads / N`` each, or one KV head shared by ``N / kv_heads``
ranks where there are fewer KV heads than ranks. Row-parallel (o, down):
input columns, partial sums all-reduced, the bias added once.
Vocab-parallel (embedding, LM head): ``ceil(vocab / N)`` rows each, zero
past the vocabulary. The norms are replicated. Every source of weights is
sliced by :func:`shard_hf_tensor`, so a safetensors reader reads only this
rank's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

import torch

from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.models.config import ModelConfig

# Hugging Face weight names (their last two parts) by the way they are split.
_QUERY_ROWS = {"q_proj.weight", "q_proj.bias"}
_KV_ROWS = {"k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"}
_MLP_ROWS = {"gate_proj.weight", "up_proj.weight"}
_ATTN_COLUMNS = {"o_proj.weight"}
_MLP_COLUMNS = {"down_proj.weight"}
_VOCAB_ROWS = {"embed_tokens.weight", "lm_head.weight"}


@dataclass(frozen=True)
class TPLayout:
    """What rank ``rank`` of ``size`` holds: heads, KV heads, MLP width, vocabulary rows."""

    rank: int
    size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    vocab_size: int
    vocab_per_rank: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank


def check_tp_size(config: ModelConfig, size: int) -> None:
    """Refuse, naming the numbers, a group size the heads or MLP width do not split over."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise InvalidInputError(
            f"num_attention_heads: expected a multiple of the tensor-parallel size {size}, got {heads}"
        )
    if (kv_heads >= size and kv_heads % size) or (kv_heads < size and size % kv_heads):
        raise InvalidInputError(
            f"num_key_value_heads: expected a multiple of the tensor-parallel size {size}, or a divisor of it "
            f"(each KV head then kept by several ranks), got {kv_heads}"
        )
    if config.intermediate_size % size:
        raise InvalidInputError(
            f"intermediate_size: expected a multiple of the tensor-parallel size {size}, got {config.intermediate_size}"
        )


def tp_layout(config: ModelConfig, rank: int, size: int) -> TPLayout:
    if not 0 <= rank < size:
        raise InvalidInputError(f"rank: expected an int in [0, {size}), got {rank!r}")
    check_tp_size(config, size)
    kv_heads = config.num_key_value_heads
    if kv_heads >= size:
        local_kv, kv_start = kv_heads // size, rank * (kv_heads // size)
    else:
        local_kv, kv_start = 1, rank * kv_heads // size
    return TPLayout(
        rank=rank,
        size=size,
        head_dim=config.head_dim,
        num_heads=config.num_attention_heads // size,
        num_kv_heads=local_kv,
        kv_head_start=kv_start,
        intermediate_size=config.intermediate_size // size,
        vocab_size=config.vocab_size,
        vocab_per_rank=-(-config.vocab_size // size),
    )


def hf_shard_index(layout: TPLayout, hf_name: str) -> Tuple[slice, ...]:
    """The index of this rank's part of the full Hugging Face tensor ``hf_name``
    (rows, columns or everything), stopping at the vocabulary."""
    kind = ".".join(hf_name.split(".")[-2:])
    r = layout.rank
    if kind in _QUERY_ROWS:
        return (_block(r, layout.q_size),)
    if kind in _KV_ROWS:
        return (slice(layout.kv_head_start * layout.head_dim, layout.kv_head_start * layout.head_dim + layout.kv_size),)
    if kind in _MLP_ROWS:
        return (_block(r, layout.intermediate_size),)
    if kind in _ATTN_COLUMNS:
        return (slice(None), _block(r, layout.q_size))
    if kind in _MLP_COLUMNS:
        return (slice(None), _block(r, layout.intermediate_size))
    if kind in _VOCAB_ROWS:
        start = min(layout.vocab_start, layout.vocab_size)
        return (slice(start, min(layout.vocab_start + layout.vocab_per_rank, layout.vocab_size)),)
    return (slice(None),)


def _block(rank: int, width: int) -> slice:
    return slice(rank * width, (rank + 1) * width)


def shard_hf_tensor(layout: TPLayout, hf_name: str, source: Any) -> torch.Tensor:
    """This rank's part of ``hf_name`` read from ``source`` (a tensor, or a
    safetensors slice that reads only those bytes), zero-padded past the vocabulary."""
    part = source[hf_shard_index(layout, hf_name)]
    kind = ".".join(hf_name.split(".")[-2:])
    missing = layout.vocab_per_rank - part.shape[0]
    if kind in _VOCAB_ROWS and missing:
        part = torch.cat([part, part.new_zeros(missing, *part.shape[1:])])
    return part
