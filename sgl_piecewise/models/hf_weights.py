"""Hugging Face weights into our models, whatever file they come from: the
model class of a config, the weights a config expects by Hugging Face name,
their checks, and their fusion into our parameters (QKV, gate/up)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from sgl_piecewise.errors import InvalidInputError, InvalidTypeError
from sgl_piecewise.models.config import ModelConfig
from sgl_piecewise.models.llama import LlamaForCausalLM
from sgl_piecewise.models.qwen2 import Qwen2ForCausalLM

MODEL_CLASSES = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen2ForCausalLM": Qwen2ForCausalLM}

# Checkpoint entries that carry no weight of ours: rotary caches that old
# exports saved as buffers, and the copy of a tied lm_head some exports keep
# (transformers ignores it too and ties to the embedding).
_ROTARY_BUFFER_SUFFIX = ".rotary_emb.inv_freq"
_TIED_HEAD = "lm_head.weight"

INDEX_FILE = "model.safetensors.index.json"


def new_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> LlamaForCausalLM:
    """The model class of ``config.architecture``, parameters uninitialised."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidTypeError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    return MODEL_CLASSES[config.architecture](config, dtype=dtype, device=device)


def hf_weight_shapes(config: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of ``config`` holds, with its shape."""
    h, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    shapes: Dict[str, Tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes[_TIED_HEAD] = (v, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
        )
        if config.qkv_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            )
        if config.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
    return shapes


def check_hf_weights(config: ModelConfig, tensors: Dict[str, torch.Tensor]) -> None:
    """Raise naming every missing, unexpected or misshapen checkpoint tensor."""
    expected = hf_weight_shapes(config)
    ignorable = {n for n in tensors if n.endswith(_ROTARY_BUFFER_SUFFIX)}
    if config.tie_word_embeddings:
        ignorable.add(_TIED_HEAD)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - ignorable)
    if missing or unexpected:
        found = [
            f"{what} {_abbrev(names)}" for what, names in (("missing", missing), ("unexpected", unexpected)) if names
        ]
        raise InvalidInputError(
            f"checkpoint weights for {config.architecture}: expected exactly the tensors "
            f"config.json implies, got {' and '.join(found)}"
        )
    bad = [
        f"{n}: expected {list(shape)}, got {list(tensors[n].shape)}"
        for n, shape in expected.items()
        if tuple(tensors[n].shape) != shape
    ]
    if bad:
        raise InvalidInputError("checkpoint weight shapes do not match config.json: " + "; ".join(bad[:8]))


def _abbrev(names: List[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"


def fuse_hf_weights(config: ModelConfig, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Checked checkpoint tensors -> our parameter names (fused projections)."""
    ours = {n: t for n, t in tensors.items() if n in hf_weight_shapes(config)}
    for i in range(config.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        kinds = ("weight", "bias") if config.qkv_bias else ("weight",)
        for kind in kinds:
            parts = [ours.pop(f"{attn}{p}_proj.{kind}") for p in "qkv"]
            ours[f"{attn}qkv_proj.{kind}"] = torch.cat(parts, dim=0)
        parts = [ours.pop(f"{mlp}{p}_proj.weight") for p in ("gate", "up")]
        ours[f"{mlp}gate_up_proj.weight"] = torch.cat(parts, dim=0)
    return ours
