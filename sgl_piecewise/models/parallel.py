"""Tensor parallelism of the Llama-family models (Megatron-style): what rank
``r`` of ``N`` holds of each weight, and the slicing that gives it.

* **column-parallel** (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``,
  ``up_proj``, weight and bias): a block of output rows. Each rank has
  ``num_attention_heads / N`` query heads and ``num_key_value_heads / N`` KV
  heads, or, when there are fewer KV heads than ranks, one KV head,
  ``rank * num_key_value_heads // N``, kept by ``N / num_key_value_heads``
  ranks each (as SGLang and vLLM do): the KV head its query heads read.
* **row-parallel** (``o_proj``, ``down_proj`` weights): a block of input
  columns; the partial sums are all-reduced, and a bias, replicated, is added
  once after the reduction.
* **vocab-parallel** (``embed_tokens``, ``lm_head``): rows ``[r * Vp, (r + 1)
  * Vp)`` with ``Vp = ceil(vocab / N)``; rows past the vocabulary are zeros.
* **replicated**: the norms and the ``o_proj`` bias.

Every source of weights (a safetensors slice, a dequantised GGUF tensor, a
seeded random draw) goes through :func:`shard_hf_tensor`: one definition of
the slice, indexed on the full tensor of each Hugging Face name, so a
safetensors reader reads only this rank's bytes. At ``N = 1`` every slice is
the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

import torch

from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.models.config import ModelConfig

# Hugging Face weight names by the way they are split: the last two parts
# of the name, e.g. "q_proj.weight".
_QUERY_ROWS = {"q_proj.weight", "q_proj.bias"}
_KV_ROWS = {"k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"}
_MLP_ROWS = {"gate_proj.weight", "up_proj.weight"}
_ATTN_COLUMNS = {"o_proj.weight"}
_MLP_COLUMNS = {"down_proj.weight"}
_VOCAB_ROWS = {"embed_tokens.weight", "lm_head.weight"}


@dataclass(frozen=True)
class TPLayout:
    """What rank ``rank`` of a tensor-parallel group of ``size`` holds of a
    model: its attention heads, KV heads, MLP width and vocabulary rows. At
    size 1, the whole model."""

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
    """Refuse a group size the model's heads or MLP width do not split over
    evenly, naming the numbers: a rank would otherwise hold a fraction of a
    head, or ranks would hold different widths."""
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
    """The :class:`TPLayout` of ``rank`` of ``size``; a size the model does
    not split over is refused (:func:`check_tp_size`)."""
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
    """The index of this rank's part of the full tensor ``hf_name`` (a
    Hugging Face weight name): rows for column-parallel and vocabulary
    weights, columns for row-parallel ones, everything for replicated ones.
    A vocabulary index stops at the vocabulary; :func:`shard_hf_tensor` pads."""
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
    """This rank's part of the full tensor ``hf_name``, read from ``source``:
    anything indexed like a tensor (a tensor, a safetensors slice, which then
    reads only these bytes). Vocabulary rows past the vocabulary are zeros."""
    part = source[hf_shard_index(layout, hf_name)]
    kind = ".".join(hf_name.split(".")[-2:])
    missing = layout.vocab_per_rank - part.shape[0]
    if kind in _VOCAB_ROWS and missing:
        part = torch.cat([part, part.new_zeros(missing, *part.shape[1:])])
    return part
