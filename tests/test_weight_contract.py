"""The weight-safety contract of every graph policy, observed from outside:
tokens, counters and errors.

* Weights updated in place after capture (``load_state_dict``, ``copy_``)
  are read by every policy's graphs, with no capture and no rerun.
* Two models of one architecture, each captured, run alternately: each
  gives its own eager tokens, and neither captures anything more.
* A weight replaced after capture (a parameter or buffer assigned, ``.data``
  rebound, ``load_state_dict(assign=True)``, its module replaced, a copy of
  another layout) is refused loudly at the next step (a ``SglPiecewiseError``,
  nothing leaked, served once captured again) or served correctly; never a
  silent wrong answer. Each case records which: its ``outcome`` user
  property, also printed (``pytest -rP``).
* Two whole-model runners on one ``ModelRunner`` both replay the weights.

Without CUDA a graph is a pass-through (whole-model and breakable) or runs
the compiled pieces on the inputs it is handed (piecewise): the CPU cases
check what reaches the pieces, the guards and the dispatch; the ``gpu`` twins
check what real graphs read.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from sgl_piecewise.compile import counters
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.engine.testing import two_layer_llama_config
from sgl_piecewise.errors import SglPiecewiseError
from sgl_piecewise.models import build_random_model
from sgl_piecewise.runners.whole_model import CudaGraphRunner

# Each compile here adds a Dynamo cache entry for the same model code; entries
# left by other tests must not push it past the recompile limit.
pytestmark = pytest.mark.usefixtures("fresh_dynamo")

POLICIES = ("full", "piecewise", "breakable", "auto")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PROMPTS = [[3, 14, 15, 92], [6, 7, 8]]  # a prefill of 7 tokens (padded to 8), then decode steps of bs 2
NEW_TOKENS = 4
CAPTURE = dict(progress=False, capture_bs=(1, 2), capture_sizes=(2, 8), piece_compiler="eager")
# The path of each step of a generate under each policy: the prefill, then the decode steps.
PATHS = {
    "full": ["eager"] + ["whole_model"] * (NEW_TOKENS - 1),
    "piecewise": ["piecewise"] * NEW_TOKENS,
    "breakable": ["breakable"] * NEW_TOKENS,
    "auto": ["piecewise"] + ["whole_model"] * (NEW_TOKENS - 1),
}
# No capture, no rerun, no fallback: the graphs captured at the start served every step.
SAME_GRAPHS = dict(graphs_captured=0, steps_rerun=0, eager_fallbacks={}, others="any")


def _model(device: str, seed: int) -> torch.nn.Module:
    config = two_layer_llama_config()
    if device == "cuda":  # the head size the device backends take
        config = dataclasses.replace(config, hidden_size=256)
    return build_random_model(config, torch.float32, device, seed=seed, std=0.2)


def _runner(model, graphs: str = "none", max_reqs: int = 2) -> ModelRunner:
    return ModelRunner(model, max_reqs=max_reqs, max_context_len=32, backend="torch", graphs=graphs)


def _captured(model, policy: str) -> ModelRunner:
    runner = _runner(model, policy)
    runner.capture_graphs(**CAPTURE)
    return runner


def _generate(runner: ModelRunner):
    return runner.generate(PROMPTS, NEW_TOKENS)


def _eager_tokens(model):
    return _generate(_runner(model))


def _last_paths(runner: ModelRunner) -> list:
    return [stat.path for stat in runner.step_stats][-NEW_TOKENS:]


# ---- weights updated in place after capture --------------------------------------
def _update_in_place(model, other, how: str) -> None:
    if how == "load_state_dict":
        model.load_state_dict(other.state_dict())
    else:
        with torch.no_grad():
            for p, q in zip(model.parameters(), other.parameters()):
                p.copy_(q)


@pytest.mark.parametrize("how", ["load_state_dict", "copy_"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["native", "adapted"])
def test_weights_updated_in_place_after_capture_are_read_by_every_policy(kind, device, policy, how):
    make = _model if kind == "native" else _adapted  # adapted: q/k/v and gate/up stacked
    model, other = make(device, seed=1), make(device, seed=2)
    runner = _captured(model, policy)
    before = _generate(runner)
    assert before == _eager_tokens(model)
    _update_in_place(model, other, how)
    want = _eager_tokens(model)
    assert want != before  # stale weights would show in the tokens
    with counters.expect(**SAME_GRAPHS):
        assert _generate(runner) == want
    assert _last_paths(runner) == PATHS[policy]


# ---- two models of one architecture ---------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("device", DEVICES)
def test_two_models_of_one_architecture_run_alternately_each_give_their_own_eager_tokens(device, policy):
    models = [_model(device, seed=seed) for seed in (1, 2)]
    wants = [_eager_tokens(model) for model in models]
    assert wants[0] != wants[1]
    runners = [_captured(model, policy) for model in models]
    with counters.expect(**SAME_GRAPHS):
        got = [(i, _generate(runners[i])) for i in (0, 1, 0)]
    for i, tokens in got:
        assert tokens == wants[i], f"model {i}"
    assert all(_last_paths(runner) == PATHS[policy] for runner in runners)


# ---- a weight replaced after capture ---------------------------------------------
def _down_proj(model) -> torch.nn.Module:
    return model.model.layers[0].mlp.down_proj  # a middle weight: neither the first nor the last


def _replace(model, other, how: str) -> None:
    """Give ``model`` ``other``'s weight (or weights) in new tensors."""
    owner, new = _down_proj(model), _down_proj(other).weight.detach().clone()
    if how == "parameter assigned":
        owner.weight = torch.nn.Parameter(new)
    elif how == ".data rebound":
        owner.weight.data = new
    elif how == "load_state_dict(assign=True)":
        model.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=True)
    elif how == "module replaced":
        model.model.layers[0].mlp.down_proj = copy.deepcopy(_down_proj(other))
    elif how == "another layout":  # same shape and values, transposed strides
        owner.weight = torch.nn.Parameter(new.t().contiguous().t())
    elif how == "buffer assigned":  # the rope table: other positions' rows
        rope = model.model.rotary_emb
        rope.cos_sin_cache = torch.roll(rope.cos_sin_cache, 1, 0).clone()
    else:
        raise AssertionError(how)


def _record(request, outcome: str) -> None:
    request.node.user_properties.append(("outcome", outcome))
    print(f"outcome: {outcome}")


REPLACEMENTS = [
    "parameter assigned",
    ".data rebound",
    "load_state_dict(assign=True)",
    "module replaced",
    "another layout",
    "buffer assigned",
]


@pytest.mark.parametrize("how", REPLACEMENTS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("device", DEVICES)
def test_a_weight_replaced_after_capture_is_refused_loudly_or_served_correctly(device, policy, how, request):
    model, other = _model(device, seed=1), _model(device, seed=2)
    runner = _captured(model, policy)
    before = _generate(runner)
    _replace(model, other, how)
    _assert_refused_loudly_or_served_correctly(runner, model, before, policy, request)


def _assert_refused_loudly_or_served_correctly(runner, model, before, policy: str, request) -> None:
    """The next generate after a replacement: an error that leaks nothing and
    is fixed by capturing again, or the replaced weights' eager tokens."""
    want = _eager_tokens(model)
    assert want != before  # the old weight's tokens would show
    free = (runner.kv_pool.available, runner.req_to_token_pool.available)
    try:
        got = _generate(runner)
    except SglPiecewiseError as exc:
        _record(request, f"refused: {type(exc).__name__}: {exc}")
        assert (runner.kv_pool.available, runner.req_to_token_pool.available) == free
        runner.capture_graphs(**CAPTURE)  # the fix the error names
        assert _generate(runner) == want
        assert _last_paths(runner) == PATHS[policy]
        return
    _record(request, "served")
    assert got == want, "a silent wrong answer after the replacement"


# ---- two whole-model runners on one ModelRunner ------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_two_whole_model_runners_on_one_model_runner_both_replay_weights_updated_in_place(device):
    model, other = _model(device, seed=1), _model(device, seed=2)
    runner = _runner(model, "full", max_reqs=4)
    runner.capture_graphs(**CAPTURE)
    first = runner.step_graphs
    second = CudaGraphRunner(runner, (2, 4))  # other sizes: buffers of its own
    second.capture(progress=False)  # captured beside the first, which still serves
    assert second is not first
    for round_ in ("captured", "updated in place"):
        if round_ == "updated in place":
            _update_in_place(model, other, "copy_")
        want = _eager_tokens(model)
        for graphs in (first, second):  # over both rounds: first, second, first, second
            runner.use_graphs(graphs)  # captured already: installed as it is
            with counters.expect(replays=NEW_TOKENS - 1, **SAME_GRAPHS):  # every decode step replayed
                assert _generate(runner) == want, round_
            assert _last_paths(runner) == PATHS["full"]
    _replace(model, other, "parameter assigned")
    for graphs in (first, second):  # each refuses
        runner.use_graphs(graphs)
        with pytest.raises(SglPiecewiseError, match=r"down_proj\.weight"):
            _generate(runner)


# ---- an adapted transformers model's stacked projections ----------------------------
def _adapted(device: str, seed: int) -> torch.nn.Module:
    """q/k/v and gate/up laid out as one block each: the compiled paths read them with one matmul."""
    transformers = pytest.importorskip("transformers")
    from sgl_piecewise.models import from_config

    head_dim = 64 if device == "cuda" else 8  # the head size the device backends take
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=4 * head_dim, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=64,
        initializer_range=0.2,
    )  # fmt: skip
    return from_config(config, torch.float32, device, seed=seed)


def _k_proj(model) -> torch.nn.Module:
    return model.hf_model.model.layers[0].self_attn.k_proj  # the middle of its block


@pytest.mark.parametrize("how", ["parameter assigned", ".data rebound"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("device", DEVICES)
def test_a_stacked_projection_replaced_after_capture_is_refused_loudly_or_served_correctly(
    device, policy, how, request
):
    model, other = _adapted(device, seed=1), _adapted(device, seed=2)
    runner = _captured(model, policy)
    before = _generate(runner)
    new = _k_proj(other).weight.detach().clone()  # out of the block
    if how == "parameter assigned":
        _k_proj(model).weight = torch.nn.Parameter(new)
    else:
        _k_proj(model).weight.data = new
    _assert_refused_loudly_or_served_correctly(runner, model, before, policy, request)
