"""Building models: from a Hugging Face checkpoint directory (config.json +
safetensors, single file or sharded), from a GGUF file (``gguf.py``), or with
seeded random weights from a config (the embedded default one included).

Checkpoint names map onto ours one to one, except that ``q_proj/k_proj/v_proj``
are concatenated into ``qkv_proj`` and ``gate_proj/up_proj`` into
``gate_up_proj``, and a tied ``lm_head`` shares the embedding. Every tensor is
checked against the shape the config implies *before* anything is fused, so
an error names the checkpoint's own tensor.
"""

from __future__ import annotations

import glob
import json
import os
from importlib import resources
from typing import Dict, Iterable, List, Optional

import torch
from safetensors import SafetensorError, safe_open

from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.models import gguf
from sgl_piecewise.models.config import ModelConfig, read_json_object
from sgl_piecewise.models.hf_weights import (
    INDEX_FILE,
    check_hf_weights,
    fuse_hf_weights,
    new_model,
)
from sgl_piecewise.models.layers import RMSNorm
from sgl_piecewise.models.llama import LlamaForCausalLM


def checkpoint_files(model_dir: str) -> List[str]:
    """The safetensors files of a checkpoint: from the shard index, else every file."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = _index_weight_map(index_path)
        files = sorted({_shard_path(model_dir, index_path, s, t) for t, s in weight_map.items()})
        absent = [p for p in files if not os.path.isfile(p)]
        if absent:
            raise InvalidInputError(f"{INDEX_FILE}: expected its shards on disk, got {absent} missing")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise InvalidInputError(f"model_dir: expected model.safetensors or {INDEX_FILE} in {model_dir!r}, got neither")
    return files


def _index_weight_map(index_path: str) -> dict:
    index = read_json_object(index_path)
    weight_map = index.get("weight_map")
    if isinstance(weight_map, dict) and weight_map:
        return weight_map
    if "weight_map" not in index:
        got = 'no "weight_map"'
    else:
        got = "an empty one" if weight_map == {} else type(weight_map).__name__
    raise InvalidInputError(
        f'{INDEX_FILE} at {index_path}: expected a non-empty "weight_map" object of '
        f"tensor name -> shard file, got {got}"
    )


def _shard_path(model_dir: str, index_path: str, shard: object, tensor: str) -> str:
    """``shard`` joined to ``model_dir``, refused if it leads out of it.

    The folders on the way are resolved (a linked folder may lead out) but not
    the file itself: the Hugging Face cache keeps every file of a checkpoint as
    a link into a shared blobs folder outside it.
    """
    root = os.path.realpath(model_dir)
    if isinstance(shard, str) and shard and not os.path.isabs(shard):
        parent, name = os.path.split(os.path.join(model_dir, shard))
        folder = os.path.realpath(parent)
        if name not in ("", ".", "..") and os.path.commonpath([root, folder]) == root:
            return os.path.join(folder, name)
    raise InvalidInputError(
        f"{INDEX_FILE} at {index_path}: expected shard files inside {model_dir}, got {shard!r} "
        f"for {tensor}; keep every shard in the checkpoint directory"
    )


def read_safetensors(files: Iterable[str]) -> Dict[str, torch.Tensor]:
    tensors: Dict[str, torch.Tensor] = {}
    for path in files:
        for name, tensor in _read_safetensors_file(path).items():
            if name in tensors:
                raise InvalidInputError(f"{name}: expected in one shard, got it twice (in {path})")
            tensors[name] = tensor
    return tensors


def _read_safetensors_file(path: str) -> dict[str, torch.Tensor]:
    # The reader's own errors do not say which file (of many shards) is bad.
    try:
        with safe_open(path, framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not iterable)
    except SafetensorError as exc:
        raise InvalidInputError(
            f"{os.path.basename(path)} at {path}: expected a readable safetensors file, got {exc}; "
            "re-download or re-save it"
        ) from exc


def load_model(
    model_dir: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LlamaForCausalLM:
    """Load a Llama or Qwen2 checkpoint, eval mode: a Hugging Face checkpoint
    directory, or a GGUF file (a ``.gguf`` path, or a directory holding one
    ``.gguf`` file and no safetensors; see ``gguf.py``)."""
    model_dir = os.fspath(model_dir)
    gguf_path = gguf.gguf_checkpoint_path(model_dir)
    if gguf_path is not None:
        return gguf.load_gguf_model(gguf_path, dtype, device)
    config = ModelConfig.from_pretrained_dir(model_dir)
    tensors = read_safetensors(checkpoint_files(model_dir))
    check_hf_weights(config, tensors)
    model = new_model(config, dtype, device)
    params = dict(model.named_parameters())
    weights = fuse_hf_weights(config, tensors)
    assert set(weights) == set(params), sorted(set(weights) ^ set(params))
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)  # casts to the model's dtype and device
    return model.eval()


def build_random_model(
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    std: float = 0.02,
) -> LlamaForCausalLM:
    """A model with seeded normal(0, ``std``) weights and unit norm scales.

    The draw happens on the CPU in float32 and is then cast, so a seed gives
    the same weights on every device and dtype.
    """
    model = new_model(config, dtype, device)
    gen = torch.Generator().manual_seed(seed)
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) in norm_params:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.eval()


def default_config() -> ModelConfig:
    """The embedded default: a small Llama-3-shaped model that runs quickly on a CPU."""
    package = resources.files("sgl_piecewise.models")
    text = package.joinpath("configs/default.json").read_text("utf-8")
    return ModelConfig.from_hf_dict(json.loads(text))


def load_model_or_default(
    model_dir: Optional[str | os.PathLike] = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> LlamaForCausalLM:
    """A checkpoint (a directory or a GGUF file, as ``load_model``) if ``model_dir``
    is given, else the default config with random weights."""
    if model_dir is None:
        return build_random_model(default_config(), dtype, device, seed)
    return load_model(model_dir, dtype, device)
