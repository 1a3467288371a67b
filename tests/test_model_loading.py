"""Reading Hugging Face configs and safetensors checkpoints, and the errors a
broken checkpoint gets: each names what is wrong."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from sgl_piecewise.errors import InvalidInputError, SglPiecewiseError
from sgl_piecewise.models import (
    LlamaForCausalLM,
    ModelConfig,
    Qwen2ForCausalLM,
    build_random_model,
    default_config,
    load_model,
    load_model_or_default,
)

TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A saved tiny HF Llama (untied lm_head), the base every broken copy starts from."""
    config = transformers.LlamaConfig(**TINY)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture
def llama_copy(llama_dir, tmp_path):
    """A private copy a test may break."""
    dst = tmp_path / "ckpt"
    shutil.copytree(llama_dir, dst)
    return dst


def _edit_weights(path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def _edit_config(path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def _params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)


def test_loaded_weights_are_the_checkpoint_tensors_with_qkv_and_gate_up_fused(llama_dir):
    model = load_model(llama_dir)
    hf = load_file(llama_dir / "model.safetensors")
    attn = model.model.layers[1].self_attn
    p = "model.layers.1."
    want_qkv = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    want_gate_up = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
    assert torch.equal(attn.qkv_proj.weight, want_qkv)
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight, want_gate_up)
    assert torch.equal(model.lm_head.weight, hf["lm_head.weight"])
    assert attn.qkv_proj.bias is None


def test_tied_qwen2_shares_embedding_and_lm_head_and_has_qkv_bias(tmp_path):
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert isinstance(model, Qwen2ForCausalLM)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    bias = model.model.layers[0].self_attn.qkv_proj.bias
    hf = load_file(tmp_path / "model.safetensors")
    want = torch.cat([hf[f"model.layers.0.self_attn.{x}_proj.bias"] for x in "qkv"])
    assert torch.equal(bias, want)


def test_sharded_checkpoint_loads_the_same_weights_as_a_single_file(llama_dir, tmp_path):
    sharded = tmp_path / "sharded"
    hf = transformers.LlamaForCausalLM.from_pretrained(llama_dir)
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert _params_equal(load_model(sharded), load_model(llama_dir))


def test_load_casts_to_the_requested_dtype(llama_dir):
    model = load_model(llama_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.bfloat16


def test_missing_weight_is_named(llama_copy):
    _edit_weights(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    want = r"got missing \[model\.layers\.1\.mlp\.up_proj\.weight\]$"
    with pytest.raises(InvalidInputError, match=want):
        load_model(llama_copy)


def test_unexpected_weight_is_named(llama_copy):
    extra = {"model.layers.0.mlp.extra.weight": torch.zeros(2)}
    _edit_weights(llama_copy, lambda t: t.update(extra))
    want = r"got unexpected \[model\.layers\.0\.mlp\.extra\.weight\]$"
    with pytest.raises(InvalidInputError, match=want):
        load_model(llama_copy)


def test_weight_of_the_wrong_shape_is_named_with_both_shapes(llama_copy):
    name = "model.layers.0.self_attn.k_proj.weight"
    _edit_weights(llama_copy, lambda t: t.update({name: torch.zeros(8, 32)}))
    with pytest.raises(InvalidInputError, match=rf"{name}: expected \[16, 32\], got \[8, 32\]"):
        load_model(llama_copy)


def test_unsupported_architecture_names_the_supported_ones(llama_copy):
    _edit_config(llama_copy, lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    want = "expected one of LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, .*, got .*GPT2LMHeadModel"
    with pytest.raises(InvalidInputError, match=want):
        load_model(llama_copy)


def test_unknown_rope_type_is_rejected_in_both_config_spellings():
    base = {"architectures": ["LlamaForCausalLM"], **TINY}
    new_style = {**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}
    old_style = {**base, "rope_theta": 1e4, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    for d in (new_style, old_style):
        want = "rope type: expected one of default, llama3, got 'yarn'"
        with pytest.raises(InvalidInputError, match=want):
            ModelConfig.from_hf_dict(d)


def test_transformers_4_and_5_rope_spellings_give_the_same_config():
    base = {"architectures": ["LlamaForCausalLM"], **TINY}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    v4 = {**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}}
    v5 = {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    a, b = ModelConfig.from_hf_dict(v4), ModelConfig.from_hf_dict(v5)
    assert a == b and a.rope_theta == 5e5 and a.rope_scaling.original_max_position_embeddings == 32


def test_head_dim_defaults_to_hidden_over_heads():
    config = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **TINY})
    assert config.head_dim == 32 // 4


def test_kv_heads_that_do_not_divide_q_heads_are_rejected():
    d = {"architectures": ["LlamaForCausalLM"], **TINY, "num_key_value_heads": 3}
    with pytest.raises(InvalidInputError, match="num_key_value_heads: expected a divisor .*got 3"):
        ModelConfig.from_hf_dict(d)


def tiny_qwen2_config(**biases) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen2ForCausalLM",
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        **biases,
    )


def test_qwen2_without_qkv_bias_is_rejected():
    with pytest.raises(InvalidInputError, match="qkv_bias: expected True for Qwen2ForCausalLM"):
        tiny_qwen2_config(qkv_bias=False)


def test_directory_without_config_or_weights_gets_a_clear_error(tmp_path, llama_copy):
    want = "expected a Hugging Face checkpoint directory with config.json"
    with pytest.raises(InvalidInputError, match=want):
        load_model(tmp_path)
    (llama_copy / "model.safetensors").unlink()
    want = "expected model.safetensors or model.safetensors.index.json"
    with pytest.raises(SglPiecewiseError, match=want):
        load_model(llama_copy)


def test_default_config_is_the_small_llama3_shaped_model():
    config = default_config()
    assert config.architecture == "LlamaForCausalLM"
    # head_dim 64: a size every attention backend serves (FlashInfer's FA2
    # kernels have no valid tile for 32).
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (256, 4, 64)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.intermediate_size == 768 and config.vocab_size == 4096
    assert config.max_position_embeddings == 2048
    assert config.rope_theta == 500000.0 and config.rope_scaling is not None


def test_random_model_is_reproducible_from_its_seed():
    config = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **TINY})
    a, b = build_random_model(config, seed=3), build_random_model(config, seed=3)
    c = build_random_model(config, seed=4)
    assert _params_equal(a, b) and not _params_equal(a, c)
    norm = a.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    assert 0.015 < a.model.layers[0].mlp.down_proj.weight.std().item() < 0.025


def test_load_model_or_default_without_a_path_gives_the_default_random_model():
    model = load_model_or_default(None, seed=5)
    assert isinstance(model, LlamaForCausalLM) and model.config == default_config()
    assert _params_equal(model, build_random_model(default_config(), seed=5))


def test_tied_checkpoint_that_also_stores_lm_head_loads_and_keeps_the_tie(tmp_path):
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)

    def add_head_copy(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    _edit_weights(tmp_path, add_head_copy)
    model = load_model(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_config_json_that_is_not_json_is_named_with_the_parse_error(llama_copy):
    (llama_copy / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    want = rf"config\.json at .*{llama_copy.name}.*: expected valid JSON, got .*line 1"
    with pytest.raises(InvalidInputError, match=want) as info:
        load_model(llama_copy)
    assert str(llama_copy / "config.json") in str(info.value)


def test_config_json_whose_top_level_is_not_an_object_is_rejected(llama_copy):
    (llama_copy / "config.json").write_text("[1, 2]")
    want = r"config\.json at .*: expected a JSON object at the top level, got list"
    with pytest.raises(InvalidInputError, match=want):
        load_model(llama_copy)


@pytest.mark.parametrize("damage", ["truncated", "not_safetensors"])
def test_corrupt_safetensors_file_is_named_and_keeps_the_reader_error(llama_copy, damage):
    path = llama_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a tensor file")
    want = r"model\.safetensors at .*: expected a readable safetensors file, got "
    with pytest.raises(InvalidInputError, match=want) as info:
        load_model(llama_copy)
    assert str(path) in str(info.value)
    assert type(info.value.__cause__).__name__ == "SafetensorError"


def _index_every_tensor_to(path, shard: str) -> None:
    """Write a shard index that maps every tensor of the checkpoint to ``shard``."""
    names = load_file(path / "model.safetensors").keys()
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, shard)}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def _move_weights_out(path):
    """Move the weights to a sibling directory ``elsewhere``; return the new file."""
    outside = path.parent / "elsewhere"
    outside.mkdir()
    return shutil.move(path / "model.safetensors", outside / "model.safetensors")


def test_index_entry_with_dotdot_outside_the_checkpoint_is_refused_by_name(llama_copy):
    _index_every_tensor_to(llama_copy, "../elsewhere/model.safetensors")
    _move_weights_out(llama_copy)
    want = r"expected shard files inside .*, got '\.\./elsewhere/model\.safetensors' for [\w.]+\.weight;"
    with pytest.raises(InvalidInputError, match=want):
        load_model(llama_copy)


def test_index_entry_with_an_absolute_path_is_refused_by_name(llama_copy):
    target = llama_copy.parent / "elsewhere" / "model.safetensors"
    _index_every_tensor_to(llama_copy, str(target))
    _move_weights_out(llama_copy)
    with pytest.raises(InvalidInputError, match=rf"expected shard files inside .*, got '{re.escape(str(target))}'"):
        load_model(llama_copy)


def test_index_entry_through_a_symlinked_folder_outside_the_checkpoint_is_refused(llama_copy):
    _index_every_tensor_to(llama_copy, "shards/model.safetensors")
    target = _move_weights_out(llama_copy)
    (llama_copy / "shards").symlink_to(target.parent, target_is_directory=True)
    with pytest.raises(InvalidInputError, match=r"got 'shards/model\.safetensors'"):
        load_model(llama_copy)


def test_shard_files_that_are_symlinks_to_blobs_load_as_in_the_hugging_face_cache(llama_dir, llama_copy):
    # The hub cache keeps each file of a snapshot as a link into a shared blobs/ folder.
    _index_every_tensor_to(llama_copy, "model.safetensors")
    blob = _move_weights_out(llama_copy)
    (llama_copy / "model.safetensors").symlink_to(blob)
    assert _params_equal(load_model(llama_copy), load_model(llama_dir))


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("{oops", "expected valid JSON, got "),
        ("{}", r'expected a non-empty "weight_map" object .*, got no "weight_map"'),
        ('{"weight_map": ["model.safetensors"]}', r'expected a non-empty "weight_map" object .*, got list'),
        ('{"weight_map": {"model.norm.weight": 3}}', r"expected shard files inside .*, got 3 for model\.norm"),
    ],
)
def test_malformed_shard_index_is_named_with_what_is_wrong(llama_copy, text, fault):
    (llama_copy / "model.safetensors.index.json").write_text(text)
    with pytest.raises(InvalidInputError, match=r"model\.safetensors\.index\.json at .*: " + fault):
        load_model(llama_copy)


def test_llama_attention_bias_means_q_k_v_and_o_proj_bias_but_qwen2_has_no_o_proj_bias():
    llama = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **TINY, "attention_bias": True})
    qwen2 = ModelConfig.from_hf_dict({"architectures": ["Qwen2ForCausalLM"], **TINY, "attention_bias": True})
    assert llama.qkv_bias and llama.o_proj_bias
    assert qwen2.qkv_bias and not qwen2.o_proj_bias


def test_qwen2_with_o_proj_bias_is_rejected():
    with pytest.raises(InvalidInputError, match="o_proj_bias: expected False for Qwen2ForCausalLM"):
        tiny_qwen2_config(qkv_bias=True, o_proj_bias=True)


def test_llama_attention_bias_checkpoint_loads_its_o_proj_bias(tmp_path):
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, attention_bias=True)).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    hf = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj.bias"
    assert torch.equal(model.get_parameter(name), hf[name])
