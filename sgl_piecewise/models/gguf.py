"""Loading GGUF checkpoints (llama.cpp's format) of the Llama and Qwen2
families: the metadata mapped onto a Hugging Face-style config, the tensors
onto Hugging Face's names, dequantised one by one, then the safetensors
loader's path (each rank's slice, fused). Needs the ``gguf`` package, imported
only when a GGUF file is read. Under tensor parallelism each rank
dequantises every tensor whole (quantisation blocks need not fall on a
rank's columns) and slices it.

Besides the names: shapes are stored reversed (ggml order), and Llama's Q
and K rows are permuted (llama.cpp's ``LlamaModel.permute``, for its
adjacent-pair rotary), which :func:`unpermute_qk` undoes. Llama 3.1 rotary
scaling is a tensor, ``rope_freqs.weight``, read back as
``Llama3RopeScaling`` or refused.
"""

from __future__ import annotations

import functools
import glob
import math
import os
import re
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from tqdm.auto import tqdm

from sgl_piecewise.errors import InvalidInputError, InvalidTypeError
from sgl_piecewise.models.config import Llama3RopeScaling, ModelConfig
from sgl_piecewise.models.hf_weights import INDEX_FILE, check_hf_weights, hf_weight_shapes, load_hf_weights, new_model
from sgl_piecewise.models.llama import LlamaForCausalLM

# GGUF ``general.architecture`` -> our (Hugging Face) architecture name.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Architectures whose Q/K rows llama.cpp permutes (its NORM rotary mode).
PERMUTED_QK_ARCHITECTURES = ("llama",)

GGUF_MAGIC = b"GGUF"
# The fixed header: magic, version (uint32), tensor and metadata counts (uint64 each).
GGUF_HEADER_BYTES = 24
# The metadata transformers builds a GGUF tokenizer from.
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens")
ROPE_FREQS = "rope_freqs.weight"

# Fewer tensors than this load without a progress bar.
PROGRESS_MIN_TENSORS = 64

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_HF_LAYER_NAMES = {hf: g for g, hf in _LAYER_NAMES.items()}
_HF_GLOBAL_NAMES = {hf: g for g, hf in _GLOBAL_NAMES.items()}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> Optional[str]:
    """The Hugging Face name of a GGUF tensor; None for a name not mapped."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}"
    return None


def gguf_name(hf: str) -> str:
    if hf in _HF_GLOBAL_NAMES:
        return _HF_GLOBAL_NAMES[hf]
    m = _HF_LAYER.fullmatch(hf)
    if m is None or m.group(2) not in _HF_LAYER_NAMES:
        raise KeyError(hf)
    return f"blk.{m.group(1)}.{_HF_LAYER_NAMES[m.group(2)]}"


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (Hugging Face Q/K rows -> GGUF rows):
    within each head, row ``s * head_dim/2 + j`` moves to ``2j + s``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _label(path: str) -> str:
    return f"{os.path.basename(path)} at {path}"


def _import_gguf():
    try:
        import gguf
    except ImportError as exc:
        raise ImportError("loading a GGUF file needs the gguf package: pip install gguf") from exc
    return gguf


@functools.lru_cache(maxsize=None)
def _reader_class():
    """``gguf.GGUFReader`` over a plain ndarray view of its map (slicing a memmap is slow)."""
    gguf = _import_gguf()

    class PlainArrayReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._plain_data = np.asarray(value)  # a view: no copy of the file

    return PlainArrayReader


def gguf_checkpoint_path(model_path: str | os.PathLike) -> Optional[str]:
    """The GGUF file ``load_model`` should read for ``model_path``, or None for a
    Hugging Face directory: a file, or a directory with no safetensors and one
    ``*.gguf`` file (more are refused). A missing path is refused as such."""
    path = os.fspath(model_path)
    check_path_exists("model_dir", path, "a Hugging Face checkpoint directory or a .gguf file")
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        return None
    if glob.glob(os.path.join(path, "*.safetensors")) or os.path.isfile(os.path.join(path, INDEX_FILE)):
        return None
    found = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(found) > 1:
        names = [os.path.basename(f) for f in found]
        raise InvalidInputError(
            f"model_dir: expected at most one .gguf file in {path!r} (and no safetensors), got {names}; "
            "pass the path of the one to load"
        )
    return found[0] if found else None


def check_path_exists(name: str, path: str, expected: str) -> None:
    if not os.path.exists(path):
        raise InvalidInputError(f"{name}: expected {expected}, got {path!r}: no such file or directory")


def open_gguf(path: str):
    """``gguf.GGUFReader`` of ``path``; a file not GGUF, or cut short, is refused naming it."""
    reader_class = _reader_class()
    label = _label(path)
    try:
        with open(path, "rb") as f:
            head = f.read(GGUF_HEADER_BYTES)
    except OSError as exc:
        raise InvalidInputError(f"{label}: expected a readable GGUF file, got {exc}") from exc
    if head[: len(GGUF_MAGIC)] != GGUF_MAGIC:
        raise InvalidInputError(
            f"{label}: expected a GGUF file (starting with {GGUF_MAGIC!r}), got {head[: len(GGUF_MAGIC)]!r}: "
            "not a GGUF file; a checkpoint is a Hugging Face checkpoint directory or a .gguf file"
        )
    if len(head) < GGUF_HEADER_BYTES:  # the reader's error would be a bare struct or index error
        raise InvalidInputError(
            f"{label}: expected a complete GGUF file, got {len(head)} bytes, shorter than its "
            f"{GGUF_HEADER_BYTES}-byte header: truncated; re-download it"
        )
    try:
        reader = reader_class(path)
    except Exception as exc:  # a cut file fails anywhere: IndexError, reshape's ValueError, ...
        raise InvalidInputError(
            f"{label}: expected a complete GGUF file, got {os.path.getsize(path)} bytes its reader could not "
            f"parse ({type(exc).__name__}: {exc}): truncated or not a GGUF file; re-download it"
        ) from exc
    if reader.byte_order != "I":
        raise InvalidInputError(f"{label}: expected a GGUF file of this machine's byte order, got a byte-swapped one")
    return reader


def check_gguf_file(path: str, need_tokenizer: bool):
    """The reader of ``path`` once it parses and, with ``need_tokenizer``, carries
    the tokenizer metadata: the one check before a model or a tokenizer is read."""
    reader = open_gguf(path)
    if need_tokenizer:
        missing = [k for k in TOKENIZER_KEYS if k not in reader.fields]
        if missing:
            raise InvalidInputError(
                f"{_label(path)}: expected tokenizer metadata {list(TOKENIZER_KEYS)}, got {missing} missing: "
                "this GGUF file carries no tokenizer"
            )
    return reader


def _meta(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _meta_number(reader, key: str) -> Any:
    """A metadata number; a float32 one back to its shortest decimal (``1e-05``)."""
    value = _meta(reader, key)
    field = reader.fields.get(key)
    if isinstance(value, float) and field.types and field.types[0].name == "FLOAT32":
        return float(str(np.float32(value)))
    return value


def _torch_shape(tensor) -> Tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def gguf_hf_config(reader, path: str) -> Dict[str, Any]:
    label = _label(path)
    arch = _meta(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise InvalidInputError(
            f"{label}: general.architecture: expected one of {', '.join(GGUF_ARCHITECTURES)}, got {arch!r}"
        )
    splits = _meta(reader, "split.count", 1)
    if splits != 1:
        raise InvalidInputError(
            f"{label}: expected a whole GGUF file, got a shard of a split one (split.count {splits}); "
            "merge the shards first (llama-gguf-split --merge)"
        )
    experts = _meta(reader, f"{arch}.expert_count", 0)
    if experts:
        raise InvalidInputError(f"{label}: {arch}.expert_count: expected 0 (no mixture of experts), got {experts}")
    scaling = _meta(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise InvalidInputError(f"{label}: {arch}.rope.scaling.type: expected 'none', got {scaling!r}")
    required = {
        "num_hidden_layers": "block_count",
        "hidden_size": "embedding_length",
        "intermediate_size": "feed_forward_length",
        "num_attention_heads": "attention.head_count",
        "max_position_embeddings": "context_length",
    }
    missing = [f"{arch}.{k}" for k in required.values() if f"{arch}.{k}" not in reader.fields]
    if missing:
        raise InvalidInputError(f"{label}: expected metadata keys {missing}, got none of them")
    d: Dict[str, Any] = {"architectures": [GGUF_ARCHITECTURES[arch]], "hidden_act": "silu"}
    d.update({hf: _meta(reader, f"{arch}.{key}") for hf, key in required.items()})
    optional = {
        "num_key_value_heads": "attention.head_count_kv",
        "rms_norm_eps": "attention.layer_norm_rms_epsilon",
        "rope_theta": "rope.freq_base",
    }
    d.update({hf: _meta_number(reader, f"{arch}.{key}") for hf, key in optional.items()})
    d = {k: v for k, v in d.items() if v is not None}
    head_dim = _meta(reader, f"{arch}.attention.key_length")
    if head_dim is None and arch == "llama":  # llama.cpp writes the rotary width = head_dim
        head_dim = _meta(reader, f"{arch}.rope.dimension_count")
    if head_dim is not None:
        d["head_dim"] = head_dim
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors.get("token_embd.weight")
    if embd is not None and len(embd.shape) == 2:
        d["vocab_size"] = _torch_shape(embd)[0]
    else:  # the missing embedding is named by the tensor check
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        d["vocab_size"] = _meta(reader, f"{arch}.vocab_size", len(tokens.data) if tokens is not None else None)
    d["tie_word_embeddings"] = "output.weight" not in tensors
    if arch == "llama":
        d["attention_bias"] = "blk.0.attn_q.bias" in tensors
    return d


def _rope_scaling(reader, path: str, config: ModelConfig) -> Optional[Llama3RopeScaling]:
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    label = _label(path)
    half = config.head_dim // 2
    if _torch_shape(tensor) != (half,) or tensor.tensor_type.name != "F32":
        raise InvalidInputError(
            f"{label}: {ROPE_FREQS}: expected F32 of shape [{half}], got "
            f"{tensor.tensor_type.name} of shape {list(_torch_shape(tensor))}"
        )
    factors = np.asarray(tensor.data, dtype=np.float64)
    arch = _meta(reader, "general.architecture")
    factor = float(str(np.float32(factors.max())))
    originals = [_meta(reader, f"{arch}.rope.scaling.original_context_length"), 8192]
    for original in dict.fromkeys(o for o in originals if o):
        for low, high in ((1.0, 4.0),):
            want = llama3_rope_factors(config.head_dim, config.rope_theta, factor, low, high, original)
            if np.allclose(factors, want, rtol=1e-5, atol=0):
                return Llama3RopeScaling(factor, low, high, original)
    raise InvalidInputError(
        f"{label}: {ROPE_FREQS}: expected Llama 3 rotary scaling factors (factor {factor}, low/high frequency "
        f"factors 1 and 4, original context 8192), got {np.round(factors, 4).tolist()}"
    )


def llama3_rope_factors(
    head_dim: int, theta: float, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for Llama 3 scaling, as its convert script computes it."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs.astype(np.float64):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32).astype(np.float64)


def read_gguf_config(reader, path: str) -> ModelConfig:
    d = gguf_hf_config(reader, path)
    try:
        config = ModelConfig.from_hf_dict(d)
        scaling = _rope_scaling(reader, path, config)
        if scaling is not None:
            config = ModelConfig.from_hf_dict({**d, "rope_scaling": {"rope_type": "llama3", **vars(scaling)}})
    except (InvalidInputError, InvalidTypeError) as exc:
        if str(exc).startswith(_label(path)):
            raise
        raise type(exc)(f"{_label(path)}: GGUF metadata as a Hugging Face config: {exc}") from exc
    return config


def supported_tensor_types() -> List[str]:
    gguf = _import_gguf()
    from gguf.quants import _type_traits

    T = gguf.GGMLQuantizationType
    return [t.name for t in T if t in (T.F32, T.F16) or t in _type_traits]


def check_gguf_tensors(reader, path: str, config: ModelConfig) -> Dict[str, Any]:
    """``{gguf name: reader tensor}`` of every weight, names, shapes and types
    checked before anything is dequantised; errors give the file's names."""
    label = _label(path)
    expected = {gguf_name(hf): shape for hf, shape in hf_weight_shapes(config).items()}
    tensors = {t.name: t for t in reader.tensors}
    ignorable = {ROPE_FREQS}  # read by _rope_scaling
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - ignorable)
    if missing or unexpected:
        found = [f"{w} {_named(names)}" for w, names in (("missing", missing), ("unexpected", unexpected)) if names]
        raise InvalidInputError(
            f"{label}: expected exactly the tensors its metadata implies for {config.architecture}, "
            f"got {' and '.join(found)}"
        )
    bad = [
        f"{n} ({hf_name(n)}): expected shape {list(shape)}, got {list(_torch_shape(tensors[n]))} "
        f"(the file's ggml order: {[int(d) for d in tensors[n].shape.tolist()]})"
        for n, shape in expected.items()
        if _torch_shape(tensors[n]) != shape
    ]
    if bad:
        raise InvalidInputError(f"{label}: tensor shapes do not match its metadata: " + "; ".join(bad[:8]))
    supported = supported_tensor_types()
    unsupported = [
        f"{n} ({tensors[n].tensor_type.name})" for n in expected if tensors[n].tensor_type.name not in supported
    ]
    if unsupported:
        raise InvalidInputError(
            f"{label}: expected tensor types gguf's dequantiser supports ({', '.join(supported)}), "
            f"got {_named(unsupported)}"
        )
    return {n: tensors[n] for n in expected}


def _named(names: List[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"


def read_gguf_weights(
    reader, path: str, config: ModelConfig, dtype: torch.dtype = torch.float32
) -> Dict[str, torch.Tensor]:
    """Every weight under its Hugging Face name, dequantised and cast to
    ``dtype`` one at a time, Q/K rows back in Hugging Face order."""
    gguf = _import_gguf()
    tensors = check_gguf_tensors(reader, path, config)
    arch = _meta(reader, "general.architecture")
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    isatty = getattr(sys.stderr, "isatty", None)
    show = bool(isatty and isatty()) and len(tensors) >= PROGRESS_MIN_TENSORS
    out: Dict[str, torch.Tensor] = {}
    for name, t in tqdm(tensors.items(), desc=f"dequantising {os.path.basename(path)}", disable=not show):
        arr = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        arr = arr.reshape(_torch_shape(t))
        kind = name.split(".")[-2]
        if arch in PERMUTED_QK_ARCHITECTURES and kind in heads:
            arr = unpermute_qk(arr, heads[kind])
        if not arr.flags.writeable:  # F32 data is a view of the read-only file map
            arr = arr.copy()
        out[hf_name(name)] = torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)
    return out


def load_gguf_model(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LlamaForCausalLM:
    """Load a Llama or Qwen2 GGUF file into our model, eval mode."""
    path = os.fspath(path)
    reader = check_gguf_file(path, need_tokenizer=False)
    config = read_gguf_config(reader, path)
    model = new_model(config, dtype, device)  # checks dtype; parameters uninitialised
    tensors = read_gguf_weights(reader, path, config, dtype)
    try:
        check_hf_weights(config, tensors)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{_label(path)}: {exc}") from exc
    load_hf_weights(model, tensors)  # dequantised whole, then sliced
    return model.eval()
