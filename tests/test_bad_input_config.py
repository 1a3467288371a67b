"""A config.json field of the wrong JSON type is refused with the field's name
and what was expected (and, read from a directory, the file's path), not with
an ``AttributeError`` or a silently wrong model."""

import json
import re

import pytest

from sgl_piecewise.errors import InvalidInputError, InvalidTypeError
from sgl_piecewise.models import ModelConfig

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 64,
}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

OBJECT = r"expected a JSON object \(a dict\) or null, got "
FLAG = "expected true or false, got "
ARCHS = "architectures: expected one of LlamaForCausalLM, Qwen2ForCausalLM, got "
WRONG_TYPES = [
    ("rope_scaling", [{"rope_type": "llama3", **LLAMA3}], rf"rope_scaling: {OBJECT}\[.*\(list\)"),
    ("rope_scaling", "llama3", rf"rope_scaling: {OBJECT}'llama3' \(str\)"),
    ("rope_parameters", [1e4], rf"rope_parameters: {OBJECT}\[10000\.0\] \(list\)"),
    ("tie_word_embeddings", "false", rf"tie_word_embeddings: {FLAG}'false' \(str\)"),
    ("attention_bias", 1, rf"attention_bias: {FLAG}1 \(int\)"),
    ("mlp_bias", "no", rf"mlp_bias: {FLAG}'no' \(str\)"),
    ("use_sliding_window", [], rf"use_sliding_window: {FLAG}\[\] \(list\)"),
    ("architectures", "LlamaForCausalLM", ARCHS + "'LlamaForCausalLM'"),
    ("architectures", 7, ARCHS + "7"),
    ("architectures", [["LlamaForCausalLM"]], ARCHS + r"\[\['LlamaForCausalLM'\]\]"),
    ("num_key_value_heads", 0, "num_key_value_heads: expected a positive int, got 0"),
]


@pytest.mark.parametrize("field, value, want", WRONG_TYPES, ids=[f"{f}-{type(v).__name__}" for f, v, _ in WRONG_TYPES])
def test_a_field_of_the_wrong_type_is_refused_by_name(field, value, want):
    with pytest.raises(InvalidInputError, match=want):
        ModelConfig.from_hf_dict({**TINY, field: value})


def test_a_rope_scaling_list_read_from_a_directory_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "rope_scaling": [{"rope_type": "llama3", **LLAMA3}]}))
    want = rf"config\.json at {re.escape(str(path))}: rope_scaling: expected a JSON object \(a dict\) or null, got \["
    with pytest.raises(InvalidInputError, match=want) as info:
        ModelConfig.from_pretrained_dir(tmp_path)
    assert not isinstance(info.value.__cause__, AttributeError)


def test_a_value_error_read_from_a_directory_keeps_its_type_and_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "num_key_value_heads": 3}))
    with pytest.raises(InvalidInputError, match=r"config\.json at .*: num_key_value_heads: expected a divisor"):
        ModelConfig.from_pretrained_dir(tmp_path)


def test_null_settings_mean_their_defaults():
    d = {**TINY, "rope_scaling": None, "rope_parameters": None, "tie_word_embeddings": None}
    config = ModelConfig.from_hf_dict({**d, "num_key_value_heads": None, "attention_bias": None})
    assert config.rope_scaling is None and not config.tie_word_embeddings and not config.o_proj_bias
    assert config.num_key_value_heads == TINY["num_attention_heads"]


def test_both_rope_spellings_and_real_flags_still_read():
    v4 = ModelConfig.from_hf_dict({**TINY, "rope_scaling": {"rope_type": "llama3", **LLAMA3}, "attention_bias": True})
    v5 = ModelConfig.from_hf_dict(
        {**TINY, "rope_parameters": {"rope_type": "llama3", **LLAMA3}, "attention_bias": True}
    )
    assert v4 == v5 and v4.rope_scaling.factor == 8.0 and v4.qkv_bias and v4.o_proj_bias
    assert ModelConfig.from_hf_dict({**TINY, "tie_word_embeddings": True}).tie_word_embeddings


def test_a_config_that_is_not_a_mapping_is_refused():
    with pytest.raises(InvalidTypeError, match=r"config\.json: expected a JSON object \(a dict\), got list"):
        ModelConfig.from_hf_dict([TINY])
