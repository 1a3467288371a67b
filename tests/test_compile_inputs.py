"""What the ``sgl_piecewise`` backend is given: its name in a fresh process,
its options, and the static inputs (weights) its graphs were captured on."""

import dataclasses
import gc
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

from sgl_piecewise.compile import CompileOptions, counters, mark_token_axis
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.models import build_random_model, default_config
from sgl_piecewise.runners.piecewise import PiecewiseCudaGraphRunner

PROMPTS = [[1, 2, 3, 4, 5], [6, 7]]


# Each compile here adds a Dynamo cache entry for the same model code; entries
# left by other tests must not push it past the recompile limit.
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def small_config():
    return dataclasses.replace(default_config(), num_hidden_layers=2)


# ---- the name -------------------------------------------------------------------
FRESH_PROCESS = """
import torch
{first}
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
x = torch.randn(3, 8)
out = torch.compile(model, backend="sgl_piecewise")(x)
assert torch.allclose(out, model(x)), "compiled output differs"
print("ok")
"""


@pytest.mark.parametrize("first", ["", "import sgl_piecewise"], ids=["no-import", "import-first"])
def test_backend_name_works_in_a_fresh_process_with_or_without_importing_the_package(first):
    """The installed entry point alone must be enough, and importing the
    package first must not register the name twice."""
    code = textwrap.dedent(FRESH_PROCESS.format(first=first))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


# ---- options --------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, match",
    [
        ({"capture_sizes": 8}, r"capture_sizes: expected a list of token counts .*got 8"),
        ({"capture_sizes": []}, "capture_sizes: expected at least one token count, got an empty list"),
        ({"capture_sizes": [4, 0]}, r"capture_sizes: expected positive ints, got \[0\]"),
        ({"capture_sizes": [2, True]}, r"capture_sizes: expected positive ints, got \[True\]"),
        ({"cudagraphs": "false"}, "cudagraphs: expected True or False, got 'false'"),
        ({"debug_checks": 1}, "debug_checks: expected True or False, got 1"),
        ({"max_capture_size": True}, "max_capture_size: expected an int >= 1, got True"),
    ],
)
def test_bad_options_are_refused_with_the_reason(options, match):
    with pytest.raises(InvalidInputError, match=match):
        CompileOptions.from_compile_args(None, options)


def test_a_bad_option_reaches_the_caller_of_the_compiled_model_with_its_reason():
    model = build_random_model(small_config(), seed=0)
    runner = ModelRunner(model, max_reqs=2, max_context_len=64)
    runner.model_forward = torch.compile(model, backend="sgl_piecewise", options={"capture_sizes": 8})
    with pytest.raises(Exception, match=r"capture_sizes: expected a list of token counts"):
        runner.generate(PROMPTS, 2)


# ---- graphs belong to the weights they captured -------------------------------
def compiled_by_name(model, options):
    """``torch.compile`` by the backend's name (one backend function for
    every model, so Dynamo reuses its graph across models of one class),
    token axis marked dynamic as ``CompiledModel`` marks it."""
    compiled = torch.compile(model, backend="sgl_piecewise", options=options)

    def forward(input_ids, positions):
        mark_token_axis(input_ids, positions)
        return compiled(input_ids, positions)

    return forward


def test_two_models_of_one_architecture_each_replay_graphs_of_their_own_weights():
    """Dynamo hands the second model's weights to the graph it compiled for
    the first; graphs captured on the first model's weights must not serve
    the second. debug_checks would name a moved input; the counters show
    that the second model captured a graph set of its own."""
    config = small_config()
    options = {"cudagraphs": True, "capture_sizes": [2, 8], "debug_checks": True, "piece_compiler": "eager"}
    captured = []
    for seed in (1, 2):
        model = build_random_model(config, seed=seed)
        runner = ModelRunner(model, max_reqs=2, max_context_len=64)
        want = runner.generate(PROMPTS, 6)
        runner.model_forward = compiled_by_name(model, options)
        before = counters.graphs_captured
        assert runner.generate(PROMPTS, 6) == want
        captured.append(counters.graphs_captured - before)
    assert counters.graphs_split == 1  # one Dynamo graph served both models
    # 2 layers split into 3 non-attention pieces; each model captures them at
    # size 8 (the 7-token prefill) and size 2 (the decode steps): 6 graphs.
    assert captured == [6, 6]


def test_a_model_moved_to_new_storage_captures_new_graphs_instead_of_replaying_stale_ones():
    model = build_random_model(small_config(), seed=3)
    runner = ModelRunner(model, max_reqs=2, max_context_len=64)
    options = {"cudagraphs": True, "capture_sizes": [2], "debug_checks": True, "piece_compiler": "eager"}
    runner.model_forward = torch.compile(model, backend="sgl_piecewise", options=options)
    runner.generate(PROMPTS, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data * 1.5  # new storage, new values
    want = ModelRunner(model, max_reqs=2, max_context_len=64).generate(PROMPTS, 3)
    assert runner.generate(PROMPTS, 3) == want


# ---- weights changed between steps of captured graphs ---------------------------
# Each step guesses the last step's graph set, and each piece checks its own
# weights' addresses before its replay; the weights themselves are the last
# call's, dropped when the model reports an assignment and compared with the
# model's after each call. These change one weight of the middle layer, after
# two pieces have replayed, as a partial weight update would.
def captured_runner(device="cpu", seed=5):
    config = dataclasses.replace(default_config(), num_hidden_layers=3)
    if device == "cuda":
        config = dataclasses.replace(config, head_dim=64, hidden_size=256)
    model = build_random_model(config, device=device, seed=seed, std=0.2)
    runner = ModelRunner(model, max_reqs=2, max_context_len=64, backend="torch")
    options = CompileOptions(cudagraphs=True, capture_sizes=(2, 8), piece_compiler="eager")
    runner.use_graphs(PiecewiseCudaGraphRunner(runner, options), progress=False)
    runner.generate(PROMPTS, 3)
    return model, runner


def eager_tokens(model):
    return ModelRunner(model, max_reqs=2, max_context_len=64, backend="torch").generate(PROMPTS, 3)


def middle_weight_owner(model):
    return model.model.layers[1].mlp.down_proj


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_weight_given_new_storage_reruns_the_step_on_graphs_of_its_address(device):
    model, runner = captured_runner(device)
    owner = middle_weight_owner(model)
    with torch.no_grad():
        owner.weight.data = owner.weight.data * 1.5  # new storage, new values; no hook reports it
    want = eager_tokens(model)
    reruns, captured = counters.steps_rerun, counters.graphs_captured
    assert runner.generate(PROMPTS, 3) == want
    # The prefill found the moved weight in its third piece and ran again;
    # the decode steps guessed the new graph set. 3 layers: 4 pieces, at
    # sizes 8 and 2.
    assert counters.steps_rerun - reruns == 1
    assert counters.graphs_captured - captured == 8


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_weight_assigned_a_new_tensor_is_read_and_the_old_one_is_not_kept_alive(device):
    model, runner = captured_runner(device)
    owner = middle_weight_owner(model)
    old = weakref.ref(owner.weight)
    owner.weight = torch.nn.Parameter(owner.weight.detach() * 1.5)  # a registration hook reports it
    gc.collect()
    assert old() is None
    assert runner.generate(PROMPTS, 3) == eager_tokens(model)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_weight_swapped_where_no_hook_sees_it_is_caught_after_the_call_and_the_call_runs_again(device):
    model, runner = captured_runner(device)
    owner = middle_weight_owner(model)
    kept = owner.weight  # alive, at the captured address: the graphs could read it unnoticed
    owner._parameters["weight"] = torch.nn.Parameter(kept.detach() * 1.5)
    want = eager_tokens(model)
    reruns = counters.steps_rerun
    assert runner.generate(PROMPTS, 3) == want
    assert counters.steps_rerun > reruns
    assert kept.data_ptr()  # held to the end


# ---- the piecewise runner's dummy capture ----------------------------------------
def test_capture_of_more_tokens_than_the_context_spreads_them_over_requests():
    model = build_random_model(small_config(), seed=0)
    runner = ModelRunner(model, max_reqs=4, max_context_len=256)
    options = CompileOptions(cudagraphs=True, capture_sizes=(512, 4), piece_compiler="eager")
    runner.use_graphs(PiecewiseCudaGraphRunner(runner, options), progress=False)
    assert runner.req_to_token_pool.available == 4  # every dummy row given back
    want = ModelRunner(model, max_reqs=4, max_context_len=256).generate(PROMPTS, 3)
    assert runner.generate(PROMPTS, 3) == want


def test_capture_larger_than_the_request_table_can_hold_names_the_fix():
    model = build_random_model(small_config(), seed=0)
    runner = ModelRunner(model, max_reqs=1, max_context_len=256)
    options = CompileOptions(cudagraphs=True, capture_sizes=(512,), piece_compiler="eager")
    with pytest.raises(InvalidInputError, match="expected room for 2 requests of at most 256 tokens, got 1 free"):
        runner.use_graphs(PiecewiseCudaGraphRunner(runner, options), progress=False)
    assert runner.req_to_token_pool.available == 1


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["eager-pieces", "reduce-overhead"])
def test_gpu_two_models_of_one_architecture_each_give_their_own_eager_tokens(how):
    """Real CUDA graphs, fp32: the second model's steps must not replay
    graphs that read the first model's weights."""
    config = dataclasses.replace(small_config(), head_dim=64, hidden_size=256)
    for seed in (1, 2):
        model = build_random_model(config, device="cuda", seed=seed, std=0.2)
        runner = ModelRunner(model, max_reqs=2, max_context_len=64, backend="torch")
        want = runner.generate(PROMPTS, 8)
        if how == "reduce-overhead":
            runner.model_forward = torch.compile(model, backend="sgl_piecewise", mode="reduce-overhead")
        else:
            runner.model_forward = compiled_by_name(
                model, {"cudagraphs": True, "capture_sizes": [2, 8], "piece_compiler": "eager"}
            )
        assert runner.generate(PROMPTS, 8) == want, f"model {seed}"


def test_sizes_left_out_of_the_capture_are_captured_at_first_use():
    model = build_random_model(small_config(), seed=0)
    runner = ModelRunner(model, max_reqs=2, max_context_len=64)
    options = CompileOptions(cudagraphs=True, capture_sizes=(2, 8), piece_compiler="eager")
    graphs = PiecewiseCudaGraphRunner(runner, options)
    graphs.capture(progress=False, sizes=[8])
    assert counters.graphs_captured == 3  # 2 layers: 3 pieces around attention, at size 8
    runner.use_graphs(graphs)  # captured already: installed as it is, size 2 left to its first use
    want = ModelRunner(model, max_reqs=2, max_context_len=64).generate(PROMPTS, 3)
    assert runner.generate(PROMPTS, 3) == want
    assert counters.graphs_captured == 6  # the decode steps (2 tokens) captured size 2 on first use
    with pytest.raises(
        InvalidInputError, match=r"expected a non-empty subset of the capture sizes \[2, 8\], got \[4\]"
    ):
        graphs.capture(progress=False, sizes=[4])
