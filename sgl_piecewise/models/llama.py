"""Llama (1/2/3/3.1) decoder for causal LM, token-major, attention through
``sgl_piecewise.ops.unified_attention``. Parameter names follow Hugging
Face except the fused ``qkv_proj`` and ``gate_up_proj``. Built in a
tensor-parallel group, a model holds its rank's shard of every weight under
the same names (``parallel.py``); ``config`` stays the whole model's, and
hidden states and logits are whole on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from sgl_piecewise.distributed import TensorParallel, tensor_parallel
from sgl_piecewise.models.config import ModelConfig
from sgl_piecewise.models.layers import (
    DecoderLayer,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    gather_rows,
)
from sgl_piecewise.models.parallel import TPLayout, tp_layout


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(
        self, config: ModelConfig, layout: TPLayout, dtype: torch.dtype, device: torch.device | str, tp: TensorParallel
    ):
        super().__init__()
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(layout, config.hidden_size, dtype, device, tp)
        self.rotary_emb = RotaryEmbedding(config, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, layout, i, dtype, device, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.fused_projections = False  # layers.set_fused_projections

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]; this rank's [Tp / N, H] under sequence parallelism
        layers = self.layers
        if self.fused_projections:  # each projection normalises its input (DecoderLayer.run_fused)
            for layer in layers:
                x = layer.run_fused(positions, x, self.rotary_emb)
            return self.norm(x)
        h = layers[0].input_layernorm(x)
        # Each layer computes the next one's input norm (DecoderLayer.run); indexed,
        # as a slice of the ModuleList would build a new one inside the trace.
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            x, h = layer.run(positions, x, h, self.rotary_emb, next_norm)
        return gather_rows(self.tp, h, rows=input_ids.shape[0])  # [T, H] on every rank


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T]) -> hidden [T, H]``, inside
    ``sgl_piecewise.forward_context(batch, backend)``; logits are a separate
    call (:meth:`compute_logits`) for the rows sampled. ``tp``: the group whose
    shard it holds (the current one by default)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        self.config = config
        self.tp = tensor_parallel() if tp is None else tp
        # Refuses a group the heads or the MLP width do not split over.
        self.tp_layout = tp_layout(config, self.tp.rank, self.tp.size)
        self.model = LlamaModel(config, self.tp_layout, dtype, device, self.tp)
        self.lm_head = ParallelLMHead(self.tp_layout, config.hidden_size, dtype, device, self.tp)
        if config.tie_word_embeddings:
            # One Parameter in two places, listed once as model.embed_tokens.weight.
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)  # [T, H]

    @property
    def num_local_heads(self) -> int:
        """The query heads this rank computes (the backend's ``num_q_heads``)."""
        return self.tp_layout.num_heads

    @property
    def num_local_kv_heads(self) -> int:
        """The KV heads this rank writes and reads (its KV pool's)."""
        return self.tp_layout.num_kv_heads

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H] -> logits [N, vocab]`` float32, on every rank."""
        return self.lm_head.logits(hidden)
