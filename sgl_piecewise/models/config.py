"""Model configuration, read from a Hugging Face ``config.json``.

Two spellings of the rotary settings exist in the wild and both are read:
transformers < 5 writes ``rope_theta`` and ``rope_scaling`` at the top level;
transformers 5 writes one ``rope_parameters`` dict
(``{"rope_type": ..., "rope_theta": ..., "factor": ...}``).

Every field read is checked for its JSON type before it is used, so a
config.json with a field of the wrong type (``rope_scaling`` a list, a flag
the string ``"false"``) is refused with the field's name instead of an
``AttributeError`` or a silently wrong model.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError
from sgl_piecewise.models.architectures import NATIVE_ARCHITECTURES

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _check_positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{name}: expected a positive number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise InvalidInputError(f"{name}: expected a positive finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent rotary scaling (``rope_type: "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        _check_positive_float("rope_scaling.factor", self.factor)
        _check_positive_float("rope_scaling.low_freq_factor", self.low_freq_factor)
        _check_positive_float("rope_scaling.high_freq_factor", self.high_freq_factor)
        check_positive_int("rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings)
        # The smoothing step divides by (high - low).
        if not self.high_freq_factor > self.low_freq_factor:
            raise InvalidInputError(
                f"rope_scaling: expected high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder. ``head_dim=None`` means ``hidden / heads``."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[Llama3RopeScaling] = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    # Llama's `attention_bias` biases o_proj as well as q/k/v; Qwen2 biases q/k/v only.
    o_proj_bias: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in NATIVE_ARCHITECTURES:
            raise InvalidInputError(
                f"architecture: expected one of {', '.join(NATIVE_ARCHITECTURES)}, got {self.architecture!r}"
            )
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "max_position_embeddings",
        ):
            check_positive_int(name, getattr(self, name))
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise InvalidInputError(
                    f"head_dim: expected hidden_size divisible by num_attention_heads when "
                    f"head_dim is not given, got {self.hidden_size} and {self.num_attention_heads}"
                )
            # Frozen: the derived default is filled in once, here.
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        check_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise InvalidInputError(f"head_dim: expected an even size (rotary pairs its halves), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidInputError(
                f"num_key_value_heads: expected a divisor of num_attention_heads "
                f"({self.num_attention_heads}), got {self.num_key_value_heads}"
            )
        _check_positive_float("rms_norm_eps", self.rms_norm_eps)
        _check_positive_float("rope_theta", self.rope_theta)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise InvalidTypeError(
                f"rope_scaling: expected None or Llama3RopeScaling, got {type(self.rope_scaling).__name__}"
            )
        if self.architecture == "Qwen2ForCausalLM" and not self.qkv_bias:
            raise InvalidInputError(
                "qkv_bias: expected True for Qwen2ForCausalLM (Qwen2 always has q/k/v bias), got False"
            )
        if self.architecture == "Qwen2ForCausalLM" and self.o_proj_bias:
            raise InvalidInputError(
                "o_proj_bias: expected False for Qwen2ForCausalLM (Qwen2 has no o_proj bias), got True"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Build from the parsed ``config.json`` of a Hugging Face checkpoint."""
        if not isinstance(d, Mapping):
            raise InvalidTypeError(f"config.json: expected a JSON object (a dict), got {type(d).__name__}")
        architecture = _architecture(d)
        _reject_unsupported_features(d)
        rope_theta, rope_scaling = _rope_settings(d)
        required = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
            "max_position_embeddings",
        )
        missing = [k for k in required if k not in d]
        if missing:
            raise InvalidInputError(f"config.json: expected keys {missing}, got none of them")
        llama_bias = architecture == "LlamaForCausalLM" and _flag(d, "attention_bias")
        return cls(
            architecture=architecture,
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=_field_or(d, "num_key_value_heads", d["num_attention_heads"]),
            vocab_size=d["vocab_size"],
            max_position_embeddings=d["max_position_embeddings"],
            head_dim=d.get("head_dim"),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=_flag(d, "tie_word_embeddings"),
            qkv_bias=architecture == "Qwen2ForCausalLM" or llama_bias,
            o_proj_bias=llama_bias,
        )

    @classmethod
    def from_pretrained_dir(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        path = os.path.join(os.fspath(model_dir), "config.json")
        if not os.path.isfile(path):
            raise InvalidInputError(
                f"model_dir: expected a Hugging Face checkpoint directory with config.json, "
                f"got {os.fspath(model_dir)!r} without it"
            )
        d = read_json_object(path)
        try:
            return cls.from_hf_dict(d)
        except (InvalidInputError, InvalidTypeError) as exc:  # name the file, as read_json_object does
            raise type(exc)(f"{os.path.basename(path)} at {path}: {exc}") from exc


def read_json_object(path: str) -> dict:
    """The JSON object in the file at ``path``; an error names the file and the fault."""
    label = f"{os.path.basename(path)} at {path}"
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"{label}: expected valid JSON, got {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidInputError(f"{label}: expected a JSON object at the top level, got {type(value).__name__}")
    return value


def _field_or(d: Mapping[str, Any], name: str, default: Any) -> Any:
    """``d[name]``, or ``default`` where it is absent or null (not where it is 0 or false)."""
    value = d.get(name)
    return default if value is None else value


def _flag(d: Mapping[str, Any], name: str) -> bool:
    """A JSON boolean (absent or null: false); ``bool("false")`` would be True."""
    value = _field_or(d, name, False)
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name}: expected true or false, got {value!r} ({type(value).__name__})")
    return value


def _object_or_null(d: Mapping[str, Any], name: str) -> Optional[Mapping[str, Any]]:
    """A field that holds a JSON object or null."""
    value = d.get(name)
    if value is not None and not isinstance(value, Mapping):
        raise InvalidInputError(
            f"{name}: expected a JSON object (a dict) or null, got {value!r} ({type(value).__name__})"
        )
    return value


def _architecture(d: Mapping[str, Any]) -> str:
    """The one supported architecture ``d`` names. Checked before any other
    key is read: another family's config.json differs in its other keys
    (GPT-2's ``n_embd``, Gemma's ``hidden_act``), and the error about them
    would hide that the architecture is the fault."""
    archs = _field_or(d, "architectures", [])
    expected = f"architectures: expected one of {', '.join(NATIVE_ARCHITECTURES)}"
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise InvalidInputError(f"{expected}, got {archs!r}")
    if archs[0] not in NATIVE_ARCHITECTURES:
        raise InvalidInputError(f"{expected}, got {archs[0]!r}")
    return archs[0]


def _reject_unsupported_features(d: Mapping[str, Any]) -> None:
    """Settings the models here do not implement: refuse rather than run wrong."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise InvalidInputError(f"hidden_act: expected 'silu', got {act!r}")
    if _flag(d, "mlp_bias"):
        raise InvalidInputError("mlp_bias: expected false (no MLP bias is implemented), got true")
    if _flag(d, "use_sliding_window"):
        raise InvalidInputError("use_sliding_window: expected false (full attention only), got true")


def _rope_settings(d: Mapping[str, Any]) -> tuple[float, Optional[Llama3RopeScaling]]:
    """``(rope_theta, scaling)`` from either the transformers 4 or 5 spelling."""
    params = _object_or_null(d, "rope_parameters")
    if params is not None:
        theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = params
    else:
        theta = d.get("rope_theta", 10000.0)
        scaling = _object_or_null(d, "rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise InvalidInputError(f"rope type: expected one of {', '.join(SUPPORTED_ROPE_TYPES)}, got {rope_type!r}")
    partial = scaling.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise InvalidInputError(f"partial_rotary_factor: expected 1.0, got {partial!r}")
    if rope_type == "default":
        return theta, None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise InvalidInputError(f"llama3 rope scaling: expected keys {missing}, got {sorted(scaling)}")
    return theta, Llama3RopeScaling(**{k: scaling[k] for k in keys})
