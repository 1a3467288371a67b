"""Draft models for speculative decoding, and the ``--draft`` spelling: ``self``
(the target: every draft accepted), ``self-layers`` (:class:`LayerSkipDraft`)
or ``random`` (an unrelated model: almost none accepted). A draft is any model
``ModelRunner`` runs, with the target's vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from sgl_piecewise.errors import InvalidInputError, InvalidTypeError
from sgl_piecewise.models.config import ModelConfig
from sgl_piecewise.models.loader import build_random_model

DRAFT_KINDS = ("self", "self-layers", "random")
DRAFT_SPELLING = "self:K, self-layers:N:K or random:K (K draft tokens per step, N layers)"


class LayerSkipDraft(nn.Module):
    """The target's first ``num_layers`` layers, final norm and LM head, sharing
    its weights; its config has ``num_layers`` layers, so its KV pool does too."""

    def __init__(self, target: nn.Module, num_layers: int):
        super().__init__()
        inner = getattr(target, "model", None)
        if not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm")):
            raise InvalidTypeError(
                f"target: expected a model of sgl_piecewise.models (model.embed_tokens, .layers, .norm), "
                f"got {type(target).__name__}"
            )
        total = len(inner.layers)
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
            raise InvalidInputError(
                f"num_layers: expected an int in [1, {total}] (the target's layers), got {num_layers!r}"
            )
        self.config = dataclasses.replace(target.config, num_hidden_layers=num_layers)
        self.embed_tokens = inner.embed_tokens
        self.rotary_emb = inner.rotary_emb
        self.layers = nn.ModuleList(list(inner.layers)[:num_layers])
        self.norm = inner.norm
        self.lm_head = target.lm_head
        self.num_local_heads = target.num_local_heads
        self.num_local_kv_heads = target.num_local_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, self.rotary_emb)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)


def random_draft_model(target_config: ModelConfig, *, dtype=torch.float32, device="cpu", seed: int = 1) -> nn.Module:
    """A one-layer Llama with the target's vocabulary and context, seeded random weights."""
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=target_config.vocab_size,
        max_position_embeddings=target_config.max_position_embeddings,
    )
    return build_random_model(config, dtype, device, seed=seed, std=0.2)


@dataclass(frozen=True)
class DraftSpec:
    """A parsed ``--draft``."""

    kind: str
    num_draft_tokens: int
    num_layers: Optional[int] = None

    def __str__(self) -> str:
        middle = f":{self.num_layers}" if self.num_layers is not None else ""
        return f"{self.kind}{middle}:{self.num_draft_tokens}"


def parse_draft_spec(text: str) -> DraftSpec:
    """``self:K``, ``self-layers:N:K`` or ``random:K`` -> :class:`DraftSpec`."""
    parts = str(text).split(":")
    want = {"self": 2, "self-layers": 3, "random": 2}.get(parts[0])
    numbers = [int(p) if p.isdigit() and int(p) > 0 else None for p in parts[1:]]
    if want is None or len(parts) != want or None in numbers:
        raise InvalidInputError(f"--draft: expected {DRAFT_SPELLING} with positive ints, got {text!r}")
    if parts[0] == "self-layers":
        return DraftSpec(parts[0], numbers[1], numbers[0])
    return DraftSpec(parts[0], numbers[0])


def build_draft_model(spec: DraftSpec, target: nn.Module, seed: int = 1) -> nn.Module:
    """The draft model ``spec`` names, on the target's device and dtype."""
    if spec.kind == "self":
        return target
    if spec.kind == "self-layers":
        return LayerSkipDraft(target, spec.num_layers)
    param = next(target.parameters())
    return random_draft_model(target.config, dtype=param.dtype, device=param.device, seed=seed)
