"""Tensor-parallel Llama and Qwen2 (``sgl_piecewise/models/parallel.py``): one
rank is the model of before; each kind of weight is sliced as Megatron does
(query and KV heads, KV heads kept by several ranks, padded vocabulary);
head counts that do not split are refused; and over two gloo ranks the logits,
of random weights or of a safetensors checkpoint, are one rank's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

from sgl_piecewise.backends import ReferenceBackend
from sgl_piecewise.context import forward_context
from sgl_piecewise.distributed import TensorParallel, launch, tensor_parallel
from sgl_piecewise.engine.testing import place_requests, two_layer_llama_config
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.forward import ForwardBatch, ForwardMode
from sgl_piecewise.memory import KVPool, ReqToTokenPool
from sgl_piecewise.models import LlamaForCausalLM, ModelConfig, build_random_model, load_model
from sgl_piecewise.models.hf_weights import hf_weight_shapes, load_hf_weights, param_shapes, shard_param
from sgl_piecewise.models.parallel import hf_shard_index, tp_layout

PREFIX_LENS, EXTEND_LENS = [3, 0, 5], [4, 2, 3]
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def _config(**changes) -> ModelConfig:
    base = dict(
        architecture="LlamaForCausalLM",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=10,
        max_position_embeddings=64,
    )
    return ModelConfig(**{**base, **changes})


# One KV head over two ranks (each keeps it), an odd vocabulary (the second
# rank's last row is padding), q/k/v bias and tied embeddings.
FEW_KV_HEADS = _config(
    architecture="Qwen2ForCausalLM",
    num_attention_heads=4,
    num_key_value_heads=1,
    vocab_size=255,
    qkv_bias=True,
    tie_word_embeddings=True,
)
# Llama's attention_bias (q/k/v and o_proj), an untied head, an odd vocabulary.
WITH_BIAS = _config(num_attention_heads=4, num_key_value_heads=2, vocab_size=101, qkv_bias=True, o_proj_bias=True)


def _group(rank: int, size: int) -> TensorParallel:
    """A group with no process groups: enough to build one rank's shard
    here, without processes (its forward would need the real group)."""
    return TensorParallel(rank=rank, size=size, group_name="unlaunched")


def _one_rank_shapes(c: ModelConfig) -> list:
    """The parameters of the one-rank model, in order, written out from the config."""
    h, f, v = c.hidden_size, c.intermediate_size, c.vocab_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = [("model.embed_tokens.weight", (v, h))]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.qkv_proj.weight", (q + 2 * kv, h))]
        shapes += [(p + "self_attn.qkv_proj.bias", (q + 2 * kv,))] if c.qkv_bias else []
        shapes += [(p + "self_attn.o_proj.weight", (h, q))]
        shapes += [(p + "self_attn.o_proj.bias", (h,))] if c.o_proj_bias else []
        shapes += [(p + "post_attention_layernorm.weight", (h,)), (p + "mlp.gate_up_proj.weight", (2 * f, h))]
        shapes += [(p + "mlp.down_proj.weight", (h, f))]
    shapes += [("model.norm.weight", (h,))]
    return shapes + ([] if c.tie_word_embeddings else [("lm_head.weight", (v, h))])


@pytest.mark.parametrize("config", [two_layer_llama_config(), FEW_KV_HEADS, WITH_BIAS], ids=["llama", "qwen2", "bias"])
def test_one_rank_model_has_the_parameters_of_before(config):
    model = build_random_model(config)
    assert model.tp.size == 1 and model.config is config
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == _one_rank_shapes(config)
    assert (model.num_local_heads, model.num_local_kv_heads) == (config.num_attention_heads, config.num_key_value_heads)


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_one_rank_forward_runs_no_collective_and_no_vocabulary_mask():
    model = build_random_model(FEW_KV_HEADS, seed=1)
    with _OpNames() as ops:
        _logits(model, seed=2)
    assert not [n for n in ops.names if any(c in n for c in (*COLLECTIVES, "masked_fill"))]


def _full(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _shards(config: ModelConfig, size: int, name: str, seed: int = 0):
    """(the whole parameter ``name``, each rank's slice of it)."""
    full = _full(param_shapes(config)[name], seed)
    return full, [shard_param(tp_layout(config, r, size), config, name, full) for r in range(size)]


@pytest.mark.parametrize(("size", "kv_heads"), [(2, 4), (4, 4), (2, 1), (4, 2), (4, 1)])
@pytest.mark.parametrize("kind", ["weight", "bias"])
def test_qkv_shards_hold_their_query_heads_and_their_kv_head_block_or_copy(size, kv_heads, kind):
    config = _config(num_key_value_heads=kv_heads, qkv_bias=True)
    full, shards = _shards(config, size, f"model.layers.1.self_attn.qkv_proj.{kind}")
    q, k, v = full.split([config.q_size, config.kv_size, config.kv_size])
    d = config.head_dim
    local_kv = max(kv_heads // size, 1)
    parts = [s.split([config.q_size // size, local_kv * d, local_kv * d]) for s in shards]
    assert torch.equal(torch.cat([p[0] for p in parts]), q)
    for rank, (_, k_r, v_r) in enumerate(parts):
        first = rank * kv_heads // size if kv_heads < size else rank * local_kv  # SGLang's and vLLM's rule
        rows = slice(first * d, (first + local_kv) * d)
        assert torch.equal(k_r, k[rows]) and torch.equal(v_r, v[rows])
    if kv_heads >= size:
        assert torch.equal(torch.cat([p[1] for p in parts]), k)


@pytest.mark.parametrize("size", [2, 4])
def test_gate_up_shards_hold_their_gate_rows_then_their_up_rows(size):
    config = _config()
    full, shards = _shards(config, size, "model.layers.0.mlp.gate_up_proj.weight")
    gate, up = full.chunk(2)
    assert torch.equal(torch.cat([s.chunk(2)[0] for s in shards]), gate)
    assert torch.equal(torch.cat([s.chunk(2)[1] for s in shards]), up)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", ["model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"])
def test_row_parallel_shards_hold_their_input_columns(size, name):
    full, shards = _shards(WITH_BIAS, size, name)
    assert torch.equal(torch.cat(shards, dim=1), full)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize(
    "name", ["model.layers.0.self_attn.o_proj.bias", "model.layers.0.input_layernorm.weight", "model.norm.weight"]
)
def test_o_proj_bias_and_norms_are_whole_on_every_rank(size, name):
    full, shards = _shards(WITH_BIAS, size, name)
    assert all(torch.equal(s, full) for s in shards)


@pytest.mark.parametrize(("size", "vocab", "per_rank"), [(2, 10, 5), (2, 101, 51), (4, 10, 3), (4, 9, 3)])
@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "lm_head.weight"])
def test_vocabulary_shards_are_row_blocks_padded_with_zero_rows(size, vocab, per_rank, name):
    config = _config(vocab_size=vocab)
    full, shards = _shards(config, size, name)
    assert {tuple(s.shape) for s in shards} == {(per_rank, config.hidden_size)}
    padded = torch.cat([full, full.new_zeros(size * per_rank - vocab, config.hidden_size)])
    assert torch.equal(torch.cat(shards), padded)


class _Recording:
    """A checkpoint tensor that records how it was indexed, as a safetensors
    slice would be read."""

    def __init__(self, tensor, reads):
        self.tensor, self.reads = tensor, reads

    def __getitem__(self, index):
        self.reads.append(index)
        return self.tensor[index]


@pytest.mark.parametrize("config", [FEW_KV_HEADS, WITH_BIAS], ids=["qwen2", "bias"])
def test_a_rank_loads_its_slices_reading_only_them(config):
    """A rank of two reads each sharded checkpoint tensor through its index
    only (no whole read), and holds the slices of the fused whole weights."""
    full = {n: _full(shape, i) for i, (n, shape) in enumerate(hf_weight_shapes(config).items())}
    reads = {n: [] for n in full}
    model = LlamaForCausalLM(config, tp=_group(1, 2))
    load_hf_weights(model, {n: _Recording(t, reads[n]) for n, t in full.items()})
    layout = tp_layout(config, 1, 2)
    for name, index_reads in reads.items():
        assert index_reads == [hf_shard_index(layout, name)]
        whole = all(s == slice(None) for s in index_reads[0])
        assert whole == name.endswith(("norm.weight", "o_proj.bias")), name
    one_rank = LlamaForCausalLM(config)
    load_hf_weights(one_rank, full)
    for name, param in model.named_parameters():
        assert torch.equal(param, shard_param(layout, config, name, one_rank.get_parameter(name))), name


@pytest.mark.parametrize(
    ("changes", "fault"),
    [
        (
            dict(num_attention_heads=6, num_key_value_heads=6),
            "num_attention_heads: expected a multiple of .* 4, got 6$",
        ),
        (
            dict(num_attention_heads=12, num_key_value_heads=6),
            "num_key_value_heads: expected a multiple of .* 4, .*got 6$",
        ),
        (
            dict(num_attention_heads=12, num_key_value_heads=3),
            "num_key_value_heads: expected a multiple of .* 4, .*got 3$",
        ),
        (dict(intermediate_size=98), "intermediate_size: expected a multiple of .* 4, got 98$"),
    ],
    ids=["heads", "kv-heads-not-a-multiple", "kv-heads-not-a-divisor", "intermediate"],
)
def test_head_counts_and_widths_that_do_not_split_over_4_ranks_are_refused_naming_them(changes, fault):
    config = _config(head_dim=16, **changes)
    for rank in range(4):
        with pytest.raises(InvalidInputError, match=fault):
            LlamaForCausalLM(config, tp=_group(rank, 4))


def _kv_pool_of(model, num_slots: int) -> KVPool:
    c = model.config
    return KVPool(num_slots, c.num_hidden_layers, model.num_local_kv_heads, c.head_dim)


def _step(model, seed: int):
    """A ragged EXTEND step over cached prefixes, the same on every rank:
    the pool's K/V (prefixes) drawn whole and this rank's KV heads kept."""
    c, layout = model.config, model.tp_layout
    gen = torch.Generator().manual_seed(seed)
    req_pool, kv_pool = ReqToTokenPool(max_reqs=4, max_context_len=16), _kv_pool_of(model, 48)
    rows, loc = place_requests(req_pool, kv_pool, PREFIX_LENS, EXTEND_LENS, fill_prefix=False)
    heads = slice(layout.kv_head_start, layout.kv_head_start + layout.num_kv_heads)
    for buffers in (*kv_pool.k_buffers, *kv_pool.v_buffers):
        buffers.copy_(torch.randn(kv_pool.num_slots + 1, c.num_key_value_heads, c.head_dim, generator=gen)[:, heads])
    ids = torch.randint(0, c.vocab_size, (sum(EXTEND_LENS),), generator=gen)
    batch = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, PREFIX_LENS, EXTEND_LENS, loc)
    backend = ReferenceBackend(req_pool, kv_pool, num_q_heads=model.num_local_heads)
    backend.init_forward_metadata(batch)
    return batch, backend


def _logits(model, seed: int, compiled=None) -> torch.Tensor:
    """``[T, vocab]`` float32 logits of every row of :func:`_step`."""
    batch, backend = _step(model, seed)
    with torch.no_grad(), forward_context(batch, backend):
        return model.compute_logits((model if compiled is None else compiled)(batch.input_ids, batch.positions))


def _random_case(config: ModelConfig) -> dict:
    model = build_random_model(config, seed=5, std=0.1)
    return {"logits": _logits(model, seed=6), "params": dict(model.named_parameters())}


def _compiled_case(config: ModelConfig) -> dict:
    """Logits of the model under ``torch.compile(dynamic=True, fullgraph=True)``
    (a graph break fails), and the ops of the traced graph."""
    model, graphs = build_random_model(config, seed=5, std=0.1), []

    def keep(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    compiled = torch.compile(model, backend=keep, dynamic=True, fullgraph=True)
    return {"logits": _logits(model, seed=6, compiled=compiled), "ops": graphs}


def _checkpoint_case(path: str) -> dict:
    model = load_model(path)
    return {"logits": _logits(model, seed=6)}


def _cases(checkpoint: str) -> dict:
    """Every check of one rank (or of the one-rank reference), in one process."""
    tp = tensor_parallel()
    with _OpNames() as ops:
        llama = _random_case(two_layer_llama_config())
    return {
        "rank": tp.rank,
        "llama": llama,
        "llama_collectives": [n for n in ops.names if any(c in n for c in COLLECTIVES)],
        "few_kv_heads": _random_case(FEW_KV_HEADS),
        "compiled": _compiled_case(two_layer_llama_config()),
        "checkpoint": _checkpoint_case(checkpoint),
    }


def _write_checkpoint(path, config: ModelConfig) -> None:
    gen = torch.Generator().manual_seed(9)
    tensors = {n: torch.randn(shape, generator=gen) * 0.2 for n, shape in hf_weight_shapes(config).items()}
    save_file(tensors, str(path / "model.safetensors"))
    hf = {
        "architectures": [config.architecture],
        **{k: getattr(config, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers")},
        **{k: getattr(config, k) for k in ("num_attention_heads", "num_key_value_heads", "vocab_size")},
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.o_proj_bias,
    }
    (path / "config.json").write_text(json.dumps(hf))


def test_two_ranks_give_the_logits_of_one(tmp_path):
    """Two gloo ranks against one: random weights (KV heads split; one KV
    head kept by both ranks with an odd vocabulary), the compiled model
    (one graph, its collectives in it) and a safetensors checkpoint; every
    rank holds the slices of the one-rank weights and returns whole logits."""
    _write_checkpoint(tmp_path, WITH_BIAS)
    one = _cases(str(tmp_path))
    ranks = launch(_cases, 2, str(tmp_path), timeout_s=120)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert one["llama_collectives"] == []
    for r in ranks:
        for case in ("llama", "few_kv_heads", "compiled", "checkpoint"):
            torch.testing.assert_close(r[case]["logits"], one[case]["logits"], atol=1e-5, rtol=0, msg=case)
        for case, config in (("llama", two_layer_llama_config()), ("few_kv_heads", FEW_KV_HEADS)):
            layout = tp_layout(config, r["rank"], 2)
            for name, param in r[case]["params"].items():
                assert torch.equal(param, shard_param(layout, config, name, one[case]["params"][name])), name
        # Eager: one reduction per embedding, o_proj and down_proj, one gather of the logits.
        reduces = sum("all_reduce" in n for n in r["llama_collectives"])
        assert reduces == 1 + 2 * two_layer_llama_config().num_hidden_layers
        assert sum("all_gather" in n for n in r["llama_collectives"]) == 1
        (graph,) = r["compiled"]["ops"]
        assert sum("all_reduce" in n for n in graph) == reduces
    (graph,) = one["compiled"]["ops"]
    assert not [n for n in graph if any(c in n for c in COLLECTIVES)]
