"""Which transformers models the adapter runs, read from their config alone.

A model is taken when its attention is what ``ops.unified_attention`` computes:
causal, grouped-query, one scale, over every earlier token. A config that asks
for more is refused here, before any weight is read, naming the architecture
and the feature. Two settings are kept exact by bounding the context instead:
a sliding window no shorter than the context never slides, and Phi-3's
``longrope`` keeps its short factors up to ``original_max_position_embeddings``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from sgl_piecewise.errors import InvalidInputError, InvalidTypeError
from sgl_piecewise.models.architectures import ADAPTER_ARCHITECTURES, ADAPTER_MODEL_TYPES

# Rotary types whose frequencies depend on the position only, never on the batch.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class AdaptedConfig:
    """What the library reads of a model's shape (``ModelRunner``, the
    benchmarks), taken from a transformers config; ``hf_config`` is that config."""

    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    hf_config: Any


def adapted_config(hf_config: Any, architecture: Optional[str] = None) -> AdaptedConfig:
    """The checked shape of a transformers decoder config (of a model of class
    ``architecture``, by default the one the config names); raises
    ``InvalidInputError`` naming the architecture and the feature it refuses."""
    architecture = architecture_of(hf_config, architecture)
    _refuse_unsupported_attention(architecture, hf_config)
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return AdaptedConfig(
        architecture=architecture,
        hidden_size=hf_config.hidden_size,
        num_hidden_layers=hf_config.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=_exact_context(architecture, hf_config),
        hf_config=hf_config,
    )


def architecture_of(hf_config: Any, architecture: Optional[str] = None) -> str:
    """``architecture``, else the one a config names (a config built in code
    names none: its ``model_type`` then), refused unless the adapter lists it."""
    archs = getattr(hf_config, "architectures", None) or []
    if architecture is None and not archs:
        model_type = getattr(hf_config, "model_type", None)
        architecture = ADAPTER_MODEL_TYPES.get(model_type)
        if architecture is None:
            raise _unlisted(f"none named, model_type {model_type!r}")
    elif architecture is None:
        architecture = archs[0] if len(archs) == 1 else archs
    if architecture not in ADAPTER_ARCHITECTURES:
        raise _unlisted(repr(architecture))
    return architecture


def _unlisted(got: str) -> InvalidInputError:
    return InvalidInputError(f"architectures: expected one of {', '.join(ADAPTER_ARCHITECTURES)}, got {got}")


def _refuse(architecture: str, feature: str, got: object) -> InvalidInputError:
    return InvalidInputError(
        f"{architecture}: {feature} is not supported by sgl_piecewise.ops.unified_attention (causal "
        f"grouped-query attention over the whole context), got {got!r}"
    )


def _refuse_unsupported_attention(architecture: str, c: Any) -> None:
    if getattr(c, "is_encoder_decoder", False) or getattr(c, "add_cross_attention", False):
        raise _refuse(architecture, "cross-attention (encoder-decoder)", True)
    if getattr(c, "is_causal", True) is False:
        raise _refuse(architecture, "non-causal attention", False)
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(c, name, None) is not None:
            raise _refuse(architecture, f"logit soft-capping ({name})", getattr(c, name))
    if getattr(c, "alibi", False) or getattr(c, "position_embedding_type", "rope") == "alibi":
        raise _refuse(architecture, "ALiBi position biases", True)
    rope_type = _rope_parameters(c).get("rope_type", _rope_parameters(c).get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise _refuse(architecture, f"rotary type {rope_type!r} (its frequencies follow the batch)", rope_type)
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "max_position_embeddings"):
        value = getattr(c, name, None)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidTypeError(f"{architecture} config {name}: expected a positive int, got {value!r}")


def _rope_parameters(c: Any) -> dict:
    # transformers 5 keeps one ``rope_parameters`` dict; 4 a ``rope_scaling``.
    params = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    return params if isinstance(params, dict) else {}


def _exact_context(architecture: str, c: Any) -> int:
    """The longest context the op computes exactly as transformers would."""
    context = c.max_position_embeddings
    window = _sliding_window(c)
    if window is not None:
        context = min(context, window)
    params = _rope_parameters(c)
    if params.get("rope_type", params.get("type")) == "longrope":
        # Past this length transformers swaps to the long factors for the whole
        # batch at once (by its longest request), which a ragged batch cannot follow.
        context = min(context, params.get("original_max_position_embeddings") or c.original_max_position_embeddings)
    if context < 2:
        raise _refuse(architecture, "a sliding window shorter than two tokens", window)
    return context


def _sliding_window(c: Any) -> Optional[int]:
    """The window of the layers that slide, or None where none does."""
    window = getattr(c, "sliding_window", None)
    if window is None or getattr(c, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(c, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)
