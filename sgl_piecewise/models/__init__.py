"""Llama-family models written against ``sgl_piecewise.ops.unified_attention``,
with Hugging Face config and safetensors loading, and GGUF loading; and any
listed transformers decoder through the same op (``transformers_adapter.py``).

Model code never imports ``sgl_piecewise.compile``: compilation is applied by
the caller (``torch.compile(model, backend="sgl_piecewise")``).
"""

from sgl_piecewise.models.architectures import ADAPTER_ARCHITECTURES, NATIVE_ARCHITECTURES
from sgl_piecewise.models.config import Llama3RopeScaling, ModelConfig
from sgl_piecewise.models.gguf import load_gguf_model
from sgl_piecewise.models.hf_weights import MODEL_CLASSES
from sgl_piecewise.models.layers import set_fused_projections
from sgl_piecewise.models.llama import LlamaForCausalLM
from sgl_piecewise.models.loader import (
    build_random_model,
    default_config,
    load_model,
    load_model_or_default,
)
from sgl_piecewise.models.qwen2 import Qwen2ForCausalLM
from sgl_piecewise.models.transformers_adapter import (
    TransformersModel,
    adapt,
    from_config,
    load_transformers_model,
)

__all__ = [
    "ADAPTER_ARCHITECTURES",
    "Llama3RopeScaling",
    "LlamaForCausalLM",
    "MODEL_CLASSES",
    "ModelConfig",
    "NATIVE_ARCHITECTURES",
    "Qwen2ForCausalLM",
    "TransformersModel",
    "adapt",
    "build_random_model",
    "default_config",
    "from_config",
    "load_gguf_model",
    "load_model",
    "load_model_or_default",
    "load_transformers_model",
    "set_fused_projections",
]
