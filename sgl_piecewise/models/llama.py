"""Llama (1/2/3/3.1) decoder for causal LM, token-major, attention through
``sgl_piecewise.ops.unified_attention``.

Parameter names follow Hugging Face (``model.layers.{i}.self_attn...``) except
the fused projections ``qkv_proj`` (= q, k, v concatenated on the output axis)
and ``gate_up_proj`` (= gate, up), which the loader builds.

Example::

    model = build_random_model(default_config())
    with sgl_piecewise.forward_context(batch, backend):
        hidden = model(batch.input_ids, batch.positions)   # [T, hidden]
    logits = model.compute_logits(hidden[last_rows])       # [bs, vocab] float32
"""

from __future__ import annotations

import torch
from torch import nn

from sgl_piecewise.models.config import ModelConfig
from sgl_piecewise.models.layers import DecoderLayer, Embedding, Linear, RMSNorm, RotaryEmbedding, float32_logits


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.rotary_emb = RotaryEmbedding(config, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        for layer in self.layers:
            x = layer(positions, x, self.rotary_emb)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T] int64, positions [T] int64) -> hidden [T, H]``.

    The forward must run inside ``sgl_piecewise.forward_context(batch,
    backend)``: attention reads the step's metadata and KV pool from there.
    Logits are a separate call so a caller computes them only for the rows it
    samples from.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype, device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            # One Parameter in two places: `named_parameters()` lists it once,
            # as model.embed_tokens.weight.
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)  # [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H] -> logits [N, vocab]`` float32."""
        return float32_logits(hidden, self.lm_head.weight)
