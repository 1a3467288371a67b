"""Qwen2 for causal LM.

Architecturally Qwen2 is Llama with a bias on the q/k/v projections (and,
in the small checkpoints, tied input/output embeddings). Both differences are
configuration (``ModelConfig.qkv_bias``, always on for Qwen2, and
``tie_word_embeddings``), so the model is the Llama one under its own name.
"""

from __future__ import annotations

from sgl_piecewise.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v bias; see :class:`~sgl_piecewise.models.llama.LlamaForCausalLM`."""
