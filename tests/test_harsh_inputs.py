"""Inputs a user gets wrong at the door: a checkpoint path that does not
exist, a GGUF file that is cut short, garbled or carries no tokenizer, and
a config.json of an architecture the models here do not implement. Each is
refused with the library's error naming the path (or the architecture),
and the model and tokenizer loaders refuse a bad GGUF file alike."""

from __future__ import annotations

import re

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="GGUF reading: pip install gguf")
pytest.importorskip("transformers", reason="tokenizers: pip install transformers")

from conftest import smollm2_or_skip  # noqa: E402

from sgl_piecewise.engine.text import load_tokenizer  # noqa: E402
from sgl_piecewise.errors import InvalidInputError  # noqa: E402
from sgl_piecewise.models import ModelConfig, load_model  # noqa: E402

SUPPORTED = "LlamaForCausalLM, Qwen2ForCausalLM"


def write_tokenizerless_gguf(path):
    """A valid GGUF file with a few metadata keys and one tensor, and no
    ``tokenizer.*`` keys."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.context_length", 64)
    w.add_tensor("token_embd.weight", np.arange(64 * 32, dtype=np.float32).reshape(64, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_or_skip()


def _head_of(path, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def refused_alike(path, pattern: str) -> str:
    """Both loaders refuse ``path`` with the same message, naming the file
    and matching ``pattern``."""
    messages = []
    for load in (load_model, load_tokenizer):
        with pytest.raises(InvalidInputError) as info:
            load(str(path))
        messages.append(str(info.value))
    assert messages[0] == messages[1], messages
    assert f"{path.name} at {path}" in messages[0], messages[0]
    assert re.search(pattern, messages[0]), messages[0]
    return messages[0]


# ---- a GGUF file cut short or garbled ------------------------------------------


@pytest.mark.parametrize("keep", [20, 4])
def test_a_real_gguf_cut_inside_its_header_is_refused_as_truncated_by_both_loaders(smollm2, tmp_path, keep):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(_head_of(smollm2, keep))
    refused_alike(cut, rf"expected a complete GGUF file, got {keep} bytes, shorter than its 24-byte header: truncated")


@pytest.mark.parametrize("keep", [100, 10_000])
def test_a_real_gguf_cut_inside_its_metadata_is_refused_by_both_loaders(smollm2, tmp_path, keep):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(_head_of(smollm2, keep))
    refused_alike(cut, rf"expected a complete GGUF file, got {keep} bytes its reader could not parse .*: truncated")


def test_a_gguf_cut_inside_its_tensor_data_is_refused_by_both_loaders(tmp_path):
    data = write_tokenizerless_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    refused_alike(cut, r"expected a complete GGUF file, got \d+ bytes its reader could not parse .*: truncated")


def test_a_file_without_the_gguf_magic_is_refused_as_not_gguf_by_both_loaders(smollm2, tmp_path):
    garbled = tmp_path / "garbled.gguf"
    garbled.write_bytes(b"GGML" + _head_of(smollm2, 4096)[4:])
    refused_alike(garbled, r"expected a GGUF file \(starting with b'GGUF'\), got b'GGML': not a GGUF file")


def test_a_gguf_without_tokenizer_metadata_is_refused_by_the_tokenizer_loader_naming_the_keys(tmp_path):
    path = write_tokenizerless_gguf(tmp_path / "no-tokenizer.gguf")
    want = (
        rf"{re.escape(f'{path.name} at {path}')}: expected tokenizer metadata "
        r"\['tokenizer\.ggml\.model', 'tokenizer\.ggml\.tokens'\], got "
        r"\['tokenizer\.ggml\.model', 'tokenizer\.ggml\.tokens'\] missing: this GGUF file carries no tokenizer"
    )
    with pytest.raises(InvalidInputError, match=want):
        load_tokenizer(str(path))


# ---- a path that does not exist ------------------------------------------------


@pytest.mark.parametrize("name", ["model.gguf", "checkpoint-dir"])
def test_a_missing_path_is_refused_as_such_naming_it(tmp_path, name):
    path = str(tmp_path / name)
    with pytest.raises(InvalidInputError, match=rf"model_dir: .*got '{re.escape(path)}': no such file or directory"):
        load_model(path)
    with pytest.raises(InvalidInputError, match=rf"checkpoint: .*got '{re.escape(path)}': no such file or directory"):
        load_tokenizer(path)


def test_load_model_of_a_missing_gguf_does_not_blame_a_missing_config_json():
    with pytest.raises(InvalidInputError) as info:
        load_model("/nonexistent.gguf")
    assert "config.json" not in str(info.value) and "'/nonexistent.gguf': no such file" in str(info.value)


# ---- an architecture the models here do not implement ---------------------------

GPT2_LIKE = {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "vocab_size": 50257,
    "activation_function": "gelu_new",
}
GEMMA_LIKE = {
    "architectures": ["GemmaForCausalLM"],
    "model_type": "gemma",
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 2048,
    "intermediate_size": 16384,
    "num_hidden_layers": 18,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 256000,
    "max_position_embeddings": 8192,
}


@pytest.mark.parametrize("config", [GPT2_LIKE, GEMMA_LIKE], ids=["gpt2", "gemma"])
def test_an_unsupported_architecture_is_named_before_any_other_key_is_read(config):
    arch = config["architectures"][0]
    with pytest.raises(InvalidInputError, match=rf"^architectures: expected one of {SUPPORTED}, got '{arch}'$"):
        ModelConfig.from_hf_dict(config)
