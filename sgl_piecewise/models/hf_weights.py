"""Hugging Face weights into our models, whatever file they come from: the
model class, the expected weights and their checks, their fusion (QKV,
gate/up), and :func:`load_hf_weights`, the one path that copies each
rank's slice into a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from sgl_piecewise.checks import check_float_dtype
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.models.config import ModelConfig
from sgl_piecewise.models.llama import LlamaForCausalLM
from sgl_piecewise.models.parallel import TPLayout, shard_hf_tensor
from sgl_piecewise.models.qwen2 import Qwen2ForCausalLM

if TYPE_CHECKING:
    from sgl_piecewise.distributed import TensorParallel

# The class of each of ``architectures.NATIVE_ARCHITECTURES``, by its name.
MODEL_CLASSES = {cls.__name__: cls for cls in (LlamaForCausalLM, Qwen2ForCausalLM)}

# Checkpoint entries that carry no weight of ours: old rotary buffers, a tied lm_head's copy.
_ROTARY_BUFFER_SUFFIX = ".rotary_emb.inv_freq"
_TIED_HEAD = "lm_head.weight"

INDEX_FILE = "model.safetensors.index.json"

# Our fused projections and the Hugging Face ones each concatenates on its first axis.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def new_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device | str, tp: Optional[TensorParallel] = None
) -> LlamaForCausalLM:
    """The model class of ``config.architecture``, uninitialised, holding ``tp``'s shard."""
    check_float_dtype("dtype", dtype)
    return MODEL_CLASSES[config.architecture](config, dtype=dtype, device=device, tp=tp)


def hf_parts(name: str) -> List[str]:
    """The Hugging Face tensors our parameter ``name`` concatenates (``[name]`` where none)."""
    stem, kind = name.rsplit(".", 1)
    for fused, parts in _FUSED.items():
        if stem.endswith("." + fused):
            base = stem[: -len(fused)]
            return [f"{base}{part}.{kind}" for part in parts]
    return [name]


def _fused_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    for fused, parts in _FUSED.items():
        for part in parts:
            if stem.endswith("." + part):
                return f"{stem[: -len(part)]}{fused}.{kind}"
    return hf_name


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


def param_shapes(config: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Every parameter of the whole (one-rank) model, fused, with its shape."""
    meta = {n: torch.empty(shape, device="meta") for n, shape in hf_weight_shapes(config).items()}
    return {n: tuple(t.shape) for n, t in fuse_hf_weights(config, meta).items()}


def check_hf_weights(config: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> None:
    check_hf_shapes(config, {n: tuple(t.shape) for n, t in tensors.items()})


def check_hf_shapes(config: ModelConfig, shapes: Mapping[str, Sequence[int]]) -> None:
    """:func:`check_hf_weights` from names and shapes alone, before any tensor is read."""
    expected = hf_weight_shapes(config)
    ignorable = {n for n in shapes if n.endswith(_ROTARY_BUFFER_SUFFIX)}
    if config.tie_word_embeddings:
        ignorable.add(_TIED_HEAD)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected) - ignorable)
    if missing or unexpected:
        found = [
            f"{what} {_abbrev(names)}" for what, names in (("missing", missing), ("unexpected", unexpected)) if names
        ]
        raise InvalidInputError(
            f"checkpoint weights for {config.architecture}: expected exactly the tensors "
            f"config.json implies, got {' and '.join(found)}"
        )
    bad = [
        f"{n}: expected {list(shape)}, got {list(shapes[n])}"
        for n, shape in expected.items()
        if tuple(shapes[n]) != shape
    ]
    if bad:
        raise InvalidInputError("checkpoint weight shapes do not match config.json: " + "; ".join(bad[:8]))


def _abbrev(names: List[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"


def fuse_hf_weights(config: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    names = dict.fromkeys(_fused_name(n) for n in hf_weight_shapes(config))
    return {name: _cat([tensors[p] for p in hf_parts(name)]) for name in names}


def _cat(parts: List[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def shard_param(layout: TPLayout, config: ModelConfig, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of our parameter ``name`` from its whole value: split
    into its Hugging Face parts, each sliced as a checkpoint's, fused again."""
    parts = hf_parts(name)
    shapes = hf_weight_shapes(config)
    pieces = full.split([shapes[p][0] for p in parts]) if len(parts) > 1 else [full]
    return _cat([shard_hf_tensor(layout, p, piece) for p, piece in zip(parts, pieces)])


def load_hf_weights(model: LlamaForCausalLM, sources: Mapping[str, Any]) -> None:
    """Copy into each parameter of ``model`` its rank's slice of the checked
    ``sources`` (Hugging Face name -> a tensor or a safetensors slice), one
    parameter at a time, cast to the model's dtype and device."""
    layout = model.tp_layout
    params = dict(model.named_parameters())
    names = dict.fromkeys(_fused_name(n) for n in hf_weight_shapes(model.config))
    assert set(names) == set(params), sorted(set(names) ^ set(params))
    with torch.no_grad():
        for name in names:
            params[name].copy_(_cat([shard_hf_tensor(layout, p, sources[p]) for p in hf_parts(name)]))
