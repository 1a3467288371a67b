"""Building models: from a Hugging Face checkpoint directory (safetensors,
single or sharded), a GGUF file (``gguf.py``), or seeded random weights
(the embedded default config included); architectures without a native
model through the transformers adapter. Every tensor is checked against the
config's shape before anything is fused, so an error names the
checkpoint's own tensor; each rank reads only its slices.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from importlib import resources
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.models import gguf
from sgl_piecewise.models.architectures import ADAPTER_ONLY, KNOWN_ARCHITECTURES
from sgl_piecewise.models.config import ModelConfig, read_json_object
from sgl_piecewise.models.hf_weights import (
    INDEX_FILE,
    check_hf_shapes,
    load_hf_weights,
    new_model,
    param_shapes,
    shard_param,
)
from sgl_piecewise.models.layers import RMSNorm
from sgl_piecewise.models.llama import LlamaForCausalLM
from sgl_piecewise.models.transformers_adapter import load_transformers_model


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
    """``shard`` joined to ``model_dir``, refused if its folders lead out of it
    (the file itself may be a link: the Hugging Face cache keeps blobs outside)."""
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


class FileSlice:
    """A safetensors tensor read only where indexed; a read error names the file."""

    def __init__(self, path: str, handle: Any, name: str):
        self.path, self.name = path, name
        self.slice = _reading(path, lambda: handle.get_slice(name))

    @property
    def shape(self) -> List[int]:
        return list(self.slice.get_shape())

    def __getitem__(self, index: tuple) -> torch.Tensor:
        return _reading(self.path, lambda: self.slice[index])


def _reading(path: str, read):
    try:
        return read()
    except SafetensorError as exc:
        raise InvalidInputError(
            f"{os.path.basename(path)} at {path}: expected a readable safetensors file, got {exc}; "
            "re-download or re-save it"
        ) from exc


@contextlib.contextmanager
def open_safetensors(files: Sequence[str]) -> Iterator[Dict[str, FileSlice]]:
    """Every tensor of the open files, by name; a name in two files is refused."""
    slices: Dict[str, FileSlice] = {}
    with contextlib.ExitStack() as stack:
        for path in files:
            handle = stack.enter_context(_reading(path, lambda p=path: safe_open(p, framework="pt")))
            for name in handle.keys():  # noqa: SIM118 (not iterable)
                if name in slices:
                    raise InvalidInputError(f"{name}: expected in one shard, got it twice (in {path})")
                slices[name] = FileSlice(path, handle, name)
        yield slices


def load_model(
    model_dir: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    adapter: bool = False,
) -> nn.Module:
    """Load a checkpoint, eval mode: a Hugging Face directory or a GGUF file (or a
    directory with one ``.gguf`` and no safetensors). ``NATIVE_ARCHITECTURES``
    load natively, ``ADAPTER_ONLY`` (or all, with ``adapter=True``) through the
    transformers adapter."""
    model_dir = os.fspath(model_dir)
    gguf_path = gguf.gguf_checkpoint_path(model_dir)
    if adapter:
        return load_transformers_model(gguf_path or model_dir, dtype, device)
    if gguf_path is not None:
        return gguf.load_gguf_model(gguf_path, dtype, device)
    if checkpoint_architecture(model_dir) in ADAPTER_ONLY:
        return load_transformers_model(model_dir, dtype, device)
    config = ModelConfig.from_pretrained_dir(model_dir)
    with open_safetensors(checkpoint_files(model_dir)) as slices:
        check_hf_shapes(config, {n: s.shape for n, s in slices.items()})
        model = new_model(config, dtype, device)
        load_hf_weights(model, slices)  # this rank's slices only
    return model.eval()


def checkpoint_architecture(model_dir: str) -> Optional[str]:
    """The architecture config.json names, refused unless a native model or the adapter runs it."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None  # ModelConfig.from_pretrained_dir says what is missing
    archs = read_json_object(path).get("architectures")
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else archs
    if arch not in KNOWN_ARCHITECTURES:
        known = ", ".join(KNOWN_ARCHITECTURES)
        raise InvalidInputError(f"config.json at {path}: architectures: expected one of {known}, got {archs!r}")
    return arch


def build_random_model(
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    std: float = 0.02,
) -> LlamaForCausalLM:
    """A model with seeded normal(0, ``std``) weights and unit norm scales, drawn
    whole on the CPU in float32 then cast and sliced: a seed gives the same
    weights on every device, dtype and rank count."""
    model = new_model(config, dtype, device)
    gen = torch.Generator().manual_seed(seed)
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    shapes = param_shapes(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in norm_params:
                p.fill_(1.0)
            else:
                full = torch.randn(shapes[name], generator=gen) * std
                p.copy_(shard_param(model.tp_layout, config, name, full))
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
) -> nn.Module:
    """A checkpoint as ``load_model`` if ``model_dir`` is given, else the default config, random."""
    if model_dir is None:
        return build_random_model(default_config(), dtype, device, seed)
    return load_model(model_dir, dtype, device)
