"""``WeightGuard``: whole-model and breakable graphs read the weights where
capture found them; a weight moved since is an error, never stale output.

Weights updated in place pass; a weight rebound (``.data =``), converted,
replaced by assignment (even while the old tensor lives on) or dropped
fails, naming it. The runners check before a replay (the first and last
weights, and assignments) and after launching it (every weight), and work
again once captured again.
"""

from __future__ import annotations

import gc
import random
import weakref
from functools import partial

import pytest
import torch

from sgl_piecewise import ForwardMode, StaleGraphError
from sgl_piecewise.backends import create_backend
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.engine.testing import random_batch, release_batch, two_layer_llama_config
from sgl_piecewise.graphs.weight_guard import WeightGuard
from sgl_piecewise.models import build_random_model
from sgl_piecewise.runners.breakable import BreakableCudaGraphRunner
from sgl_piecewise.runners.whole_model import CudaGraphRunner

CONFIG = two_layer_llama_config()
VOCAB = CONFIG.vocab_size


def _model():
    return build_random_model(CONFIG, torch.float32, "cpu", seed=5, std=0.2)


def _middle_weight(model) -> torch.nn.Parameter:
    return model.model.layers[0].mlp.down_proj.weight


def test_weights_updated_in_place_pass_the_guard():
    model = _model()
    guard = WeightGuard(model, "graphs")
    with torch.no_grad():
        _middle_weight(model).mul_(2.0)
        model.load_state_dict({k: v.clone() + 1 for k, v in model.state_dict().items()})
    guard.check_first()
    guard.check()


def test_a_weight_rebound_fails_the_full_check_naming_it():
    model = _model()
    guard = WeightGuard(model, "whole-model graphs")
    weight = _middle_weight(model)
    weight.data = weight.data.clone()
    guard.check_first()  # the first and last weights did not move
    with pytest.raises(StaleGraphError, match=r"whole-model graphs: .*layers\.0\.mlp\.down_proj\.weight moved"):
        guard.check()


def test_a_converted_model_fails_the_check_before_a_replay():
    model = _model()
    guard = WeightGuard(model, "graphs")
    model.to(torch.float64)
    with pytest.raises(StaleGraphError, match=r"and \d+ more moved or dropped"):
        guard.check_first()


def test_a_weight_replaced_by_assignment_fails_while_the_old_one_lives_on():
    model = _model()
    guard = WeightGuard(model, "graphs")
    old = _middle_weight(model)  # still alive: its address still matches
    model.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(old.detach().clone())
    with pytest.raises(StaleGraphError, match=r"got model\.layers\.0\.mlp\.down_proj\.weight assigned;"):
        guard.check_first()


def test_a_weight_assigned_to_where_it_is_already_is_no_change():
    model = _model()
    guard = WeightGuard(model, "graphs")
    mlp = model.model.layers[0].mlp
    mlp.down_proj.weight = mlp.down_proj.weight
    mlp.down_proj = mlp.down_proj
    guard.check_first()
    guard.check()


def test_state_loaded_by_assignment_fails():
    model = _model()
    guard = WeightGuard(model, "graphs")
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    with pytest.raises(StaleGraphError, match="assigned"):
        guard.check_first()


def test_the_guard_keeps_no_weight_alive_and_a_dropped_one_fails():
    model = _model()
    guard = WeightGuard(model, "graphs")
    ref = weakref.ref(_middle_weight(model))
    del model.model.layers[0].mlp.down_proj.weight  # dropped, not assigned: no hook fires
    gc.collect()
    assert ref() is None
    with pytest.raises(StaleGraphError, match=r"down_proj\.weight moved or dropped"):
        guard.check()


def test_another_models_assignments_leave_the_guard_alone():
    model, other = _model(), _model()
    guard = WeightGuard(model, "graphs")
    other.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(torch.zeros(1))
    guard.check_first()
    guard.check()


def _runners(kind: str, device="cpu", dtype=torch.float32):
    """An eager runner and a graph runner of ``kind`` over one model (separate
    pools), the graphs captured."""
    model = build_random_model(CONFIG, dtype, device, seed=5, std=0.2)
    kwargs = dict(max_reqs=8, max_context_len=96, backend=partial(create_backend, "torch", num_q_heads=4))
    eager, graphs = ModelRunner(model, **kwargs), ModelRunner(model, **kwargs)
    runner = CudaGraphRunner(graphs, (1, 2, 4)) if kind == "whole" else BreakableCudaGraphRunner(graphs, (1, 2, 4))
    graphs.use_graphs(runner, progress=False)
    return model, eager, graphs


def _step(runner: ModelRunner, seed: int):
    rng = random.Random(seed)
    prefix = [rng.randint(0, 40) for _ in range(3)]
    gen = torch.Generator().manual_seed(seed)
    batch = random_batch(ForwardMode.DECODE, runner.req_to_token_pool, runner.kv_pool, prefix, [1] * 3,
                         vocab_size=VOCAB, generator=gen)  # fmt: skip
    try:
        return runner.forward_step(batch)
    finally:
        release_batch(runner.req_to_token_pool, runner.kv_pool, batch)


@pytest.mark.parametrize("kind", ["whole", "breakable"])
def test_a_runner_refuses_to_replay_after_a_weight_moved_and_replays_again_once_captured_again(kind):
    model, eager, graphs = _runners(kind)
    weight = _middle_weight(model)
    weight.data = weight.data * 1.5  # moved, with new values
    with pytest.raises(StaleGraphError, match="graphs: expected the model's weights"):
        _step(graphs, seed=1)
    (graphs.step_graphs if kind == "whole" else graphs.token_graphs).capture(progress=False)
    # fp32 on a CPU; a padded batch: as the runners' own tests compare
    torch.testing.assert_close(_step(graphs, seed=2), _step(eager, seed=2), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["whole", "breakable"])
def test_gpu_real_graphs_refuse_moved_weights_before_and_after_a_replay_and_replay_again_once_captured_again(kind):
    model, eager, graphs = _runners(kind, "cuda", torch.bfloat16)
    model.to(torch.float32).to(torch.bfloat16)  # every weight at a new address: refused before any replay
    with pytest.raises(StaleGraphError, match="moved or dropped"):
        _step(graphs, seed=1)
    runner = graphs.step_graphs if kind == "whole" else graphs.token_graphs
    runner.capture(progress=False)
    weight = _middle_weight(model)
    weight.data = weight.data.clone()  # one weight: caught once the graph is launched
    with pytest.raises(StaleGraphError, match=r"down_proj\.weight moved"):
        _step(graphs, seed=3)
    runner.capture(progress=False)
    # A padded batch: launch choices may reorder sums, bf16 tolerance as the runners' own tests.
    torch.testing.assert_close(_step(graphs, seed=2), _step(eager, seed=2), rtol=5e-2, atol=5e-2)
