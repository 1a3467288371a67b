"""A transformers causal LM, unchanged, as a model of this library: the
registered attention implementation ``"sgl_piecewise"`` hands each layer's
q, k, v to ``ops.unified_attention`` (``layer_idx`` as ``layer_id``), a
step's tokens go through as one sequence with their own positions, no
transformers cache and no mask. Which configs are taken:
``transformers_support.py``.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any, Optional

import torch
from torch import nn

from sgl_piecewise.checks import check_float_dtype
from sgl_piecewise.distributed import tensor_parallel
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError, SglPiecewiseError
from sgl_piecewise.models import gguf
from sgl_piecewise.models.transformers_support import AdaptedConfig, adapted_config
from sgl_piecewise.ops import unified_attention

ATTENTION_IMPLEMENTATION = "sgl_piecewise"
logger = logging.getLogger("sgl_piecewise")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise SglPiecewiseError(
            "a transformers model: expected transformers installed, got none; `pip install transformers`"
        ) from None
    return transformers


def paged_attention(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention call (``[1, H, T, D]``) as the op's token-major one."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    out = unified_attention(q, k, v, layer_id=module.layer_idx, scale=scaling)
    return out.unsqueeze(0), None


def register_attention() -> None:
    """Make ``"sgl_piecewise"`` an attention transformers knows (with no mask function)."""
    _transformers().AttentionInterface.register(ATTENTION_IMPLEMENTATION, paged_attention)


class TransformersModel(nn.Module):
    """``forward(input_ids [T], positions [T]) -> hidden [T, H]`` and
    ``compute_logits`` (float32) over a transformers causal LM (``hf_model``)."""

    def __init__(self, hf_model: nn.Module, config: AdaptedConfig):
        super().__init__()
        self.hf_model = hf_model
        self.config = config
        # Granite divides its logits by this; the others keep 1.
        self.logits_scaling = float(getattr(config.hf_config, "logits_scaling", 1.0) or 1.0)
        # transformers slices its layers each step; a ModuleList slice builds a
        # new module (inside a trace too, running torch's module hooks): these
        # layers slice to a plain list.
        decoder = hf_model.get_decoder()
        decoder.layers = _LayerList(decoder.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self._check_attention()
        out = self.hf_model.get_decoder()(
            input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False
        )
        return out.last_hidden_state[0]

    def _check_attention(self) -> None:
        # Another attention implementation would attend over the step's own tokens only.
        implementation = self.hf_model.config._attn_implementation
        if implementation != ATTENTION_IMPLEMENTATION:
            raise InvalidInputError(
                f"{self.config.architecture}: expected attention implementation {ATTENTION_IMPLEMENTATION!r}, got "
                f"{implementation!r}; the model's config was changed after adapt() (shared with another model?)"
            )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.hf_model.get_output_embeddings()(hidden).float()
        return logits / self.logits_scaling if self.logits_scaling != 1.0 else logits


class _LayerList(nn.ModuleList):
    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self._modules.values())[index]
        return super().__getitem__(index)


def adapt(hf_model: nn.Module) -> TransformersModel:
    """A transformers causal LM, used in place (its attention implementation
    becomes ``"sgl_piecewise"``), eval mode; refused where the op cannot
    compute its attention exactly."""
    transformers = _transformers()
    if not isinstance(hf_model, transformers.PreTrainedModel):
        raise InvalidTypeError(f"hf_model: expected a transformers PreTrainedModel, got {type(hf_model).__name__}")
    config = adapted_config(hf_model.config, type(hf_model).__name__)
    _refuse_tensor_parallel(config)
    register_attention()
    hf_model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
    lay_out_stacked_projections(hf_model)
    if config.max_position_embeddings < hf_model.config.max_position_embeddings:
        logger.info(
            "%s: context bounded to %d tokens, where its attention is what the op computes",
            config.architecture,
            config.max_position_embeddings,
        )
    return TransformersModel(hf_model.eval(), config)


# Linears of one input in a transformers layer: their weights (and biases)
# laid back to back, the compiled model reads them with one matmul
# (compile/stacked_linears.py), as the native models' merged projections do.
STACKED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def lay_out_stacked_projections(model: nn.Module) -> int:
    """Put each group of ``STACKED_PROJECTIONS`` of ``model`` in one block of
    memory, values and parameter objects unchanged; the number of groups."""
    laid = 0
    for module in model.modules():
        for names in STACKED_PROJECTIONS:
            linears = [getattr(module, name, None) for name in names]
            if _stackable(linears):
                _back_to_back([linear.weight for linear in linears])
                if linears[0].bias is not None:
                    _back_to_back([linear.bias for linear in linears])
                laid += 1
    return laid


def _stackable(linears: list) -> bool:
    if not all(type(linear) is nn.Linear for linear in linears):  # a subclass may compute otherwise
        return False
    first = linears[0].weight
    return all(
        linear.in_features == linears[0].in_features
        and (linear.bias is None) == (linears[0].bias is None)
        and linear.weight.dtype == first.dtype
        and linear.weight.device == first.device
        and not linear.weight.is_meta
        for linear in linears
    )


def _back_to_back(params: list) -> None:
    block = torch.cat([param.detach() for param in params])
    with torch.no_grad():
        for param, part in zip(params, block.split([param.shape[0] for param in params])):
            param.set_(part)


def _refuse_tensor_parallel(config: AdaptedConfig) -> None:
    size = tensor_parallel().size
    if size > 1:
        raise InvalidInputError(
            f"{config.architecture} through the transformers adapter: expected one rank, got a "
            f"tensor-parallel group of {size}; the native Llama and Qwen2 models run sharded"
        )


def from_config(
    hf_config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0
) -> TransformersModel:
    """A seeded random model of a transformers config, checked first."""
    transformers = _transformers()
    adapted_config(hf_config)  # refuse before anything is built
    check_float_dtype("dtype", dtype)
    # A copy: the model keeps its config, and the caller's keeps its attention.
    hf_config = copy.deepcopy(hf_config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return adapt(hf_model.to(device=device, dtype=dtype))


def load_transformers_model(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> TransformersModel:
    """A checkpoint directory or GGUF file read by transformers, its config checked first."""
    transformers = _transformers()
    check_float_dtype("dtype", dtype)
    path = os.fspath(path)
    gguf.check_path_exists("path", path, "a checkpoint directory or a .gguf file")
    folder, gguf_file = _gguf_parts(path)
    hf_config = transformers.AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
    adapted_config(hf_config)
    register_attention()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf_file, dtype=dtype, attn_implementation=ATTENTION_IMPLEMENTATION
    )
    return adapt(hf_model.to(device))


def _gguf_parts(path: str) -> tuple[str, Optional[str]]:
    if os.path.isfile(path):
        gguf.check_gguf_file(path, need_tokenizer=False)  # a clear error where transformers' would not be
        folder, name = os.path.split(os.path.abspath(path))
        return folder, name
    return path, None
