"""One dispatcher: ``ModelRunner(graphs=...)`` captures what its policy needs
and routes every step to the fastest path that serves it — whole-model
graphs, piecewise or breakable graphs, else eager — counting each step by
path and reason in ``counters.step_paths``."""

from __future__ import annotations

import collections
import warnings
from functools import partial

import pytest
import torch
from test_breakable import CONFIG, VOCAB, BranchingModel

import sgl_piecewise as sp
from sgl_piecewise.backends import ReferenceBackend, create_backend
from sgl_piecewise.compile import CompileOptions, counters
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.engine.testing import random_batch, release_batch
from sgl_piecewise.errors import InvalidInputError, UnsupportedModeError
from sgl_piecewise.models import ModelConfig, build_random_model
from sgl_piecewise.runners import BreakableCudaGraphRunner, CudaGraphRunner, PiecewiseCudaGraphRunner

POLICIES = ("auto", "full", "piecewise", "breakable", "none")
CAPTURE = dict(capture_bs=(1, 2, 4), capture_sizes=(1, 2, 4, 8, 16, 32), piece_compiler="eager")
E, D, M, IDLE = sp.ForwardMode.EXTEND, sp.ForwardMode.DECODE, sp.ForwardMode.MIXED, sp.ForwardMode.IDLE


# Each compile here adds a Dynamo cache entry for the same model code; entries
# left by other tests must not push it past the recompile limit.
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _model(device="cpu", dtype=torch.float32, config=CONFIG):
    return build_random_model(config, dtype, device, seed=7, std=0.2)


# Off CUDA the triton decode grid's split axis is max_kv_splits whole (no SM
# count sizes it), one interpreted program per split and (request, kv head).
# A context here holds at most 96 keys and a split 64 (the kernel's
# tokens_per_split), so no request takes more than 2 splits: 2 keeps every
# request's split count at a 32nd of the default 64's programs.
CPU_TRITON_OPTIONS = dict(max_kv_splits=2)


def _runner(model, graphs="none", backend="torch", **kw) -> ModelRunner:
    if backend != "reference" and isinstance(backend, str):
        on_cpu = next(model.parameters()).device.type == "cpu"
        options = CPU_TRITON_OPTIONS if backend == "triton" and on_cpu else {}
        backend = partial(create_backend, backend, num_q_heads=model.config.num_attention_heads, **options)
    elif backend == "reference":
        backend = ReferenceBackend
    return ModelRunner(model, **{"max_reqs": 8, "max_context_len": 96, "backend": backend, "graphs": graphs, **kw})


def _captured(model, graphs, backend="torch") -> ModelRunner:
    runner = _runner(model, graphs, backend)
    runner.capture_graphs(progress=False, **CAPTURE)
    return runner


PROMPTS = [[3, 14, 15, 92], [6], [53, 58, 9, 7, 9, 3, 2]]  # 12 tokens


@pytest.mark.parametrize(
    "graphs, backend",
    [(p, "torch") for p in POLICIES] + [(p, "reference") for p in ("auto", "piecewise", "breakable", "none")],
)
def test_every_policy_generates_the_eager_tokens(graphs, backend):
    model = _model()
    want = _runner(model, backend=backend).generate(PROMPTS, 8)
    assert _captured(model, graphs, backend).generate(PROMPTS, 8) == want


def test_each_policy_counts_every_step_of_a_generate_by_its_path():
    """12 prompt tokens, 8 new: 1 prefill of 12 tokens, 7 decode steps of bs 3."""
    model = _model()
    expected = {
        # Whole-model graphs serve decode (bs 3 pads to 4), pieces the prefill (12 pads to 16).
        "auto": {("piecewise", "EXTEND 12 -> 16 tokens"): 1, ("whole_model", "DECODE bs 3 -> 4"): 7},
        # No graph for the prefill: eager, saying why.
        "full": {("eager", "EXTEND: no whole-model graph for this mode"): 1, ("whole_model", "DECODE bs 3 -> 4"): 7},
        # Token-axis graphs serve every mode: decode of bs 3 is 3 tokens, padded to 4.
        "piecewise": {("piecewise", "EXTEND 12 -> 16 tokens"): 1, ("piecewise", "DECODE 3 -> 4 tokens"): 7},
        "breakable": {("breakable", "EXTEND 12 -> 16 tokens"): 1, ("breakable", "DECODE 3 -> 4 tokens"): 7},
        "none": {("eager", "graphs='none'"): 8},
    }
    for graphs in POLICIES:
        runner = _captured(model, graphs)
        counters.reset()
        runner.generate(PROMPTS, 8)
        assert counters.step_paths == expected[graphs], graphs
        assert [s.path for s in runner.step_stats] == [p for (p, _), n in expected[graphs].items() for _ in range(n)]


def _step(runner, mode, prefix, extend, seed, spec=None, every_token=False):
    gen = torch.Generator().manual_seed(seed)
    batch = random_batch(mode, runner.req_to_token_pool, runner.kv_pool, prefix, extend, vocab_size=VOCAB,
                         spec_info=spec, generator=gen)  # fmt: skip
    try:
        return runner.forward_step(batch, every_token=every_token)
    finally:
        release_batch(runner.req_to_token_pool, runner.kv_pool, batch)


def test_auto_routes_every_step_to_the_fastest_path_that_serves_it_and_equals_eager():
    model = _model()
    eager, auto = _runner(model), _captured(model, "auto")
    steps = [
        (E, [0, 0, 0], [5, 2, 9]),  # 16 tokens: piecewise at 16
        (M, [7, 30, 2], [4, 1, 1]),  # prefill chunk and two decodes, 6 tokens: piecewise at 8
        (D, [4, 9, 60], [1, 1, 1]),  # bs 3: whole-model graph of bs 4
        (D, [1, 2, 3, 4, 5, 6], [1] * 6),  # bs 6 > 4: pieces at 8 tokens instead
        (E, [0, 3], [20, 20]),  # 40 tokens > 32: eager
        (M, [10, 0, 5], [1, 12, 1]),  # 14 tokens: piecewise at 16
        (IDLE, [], []),  # no tokens: eager
    ]
    counters.reset()
    for i, (mode, prefix, extend) in enumerate(steps):
        want, got = (_step(r, mode, prefix, extend, seed=i) for r in (eager, auto))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    counted = counters.step_paths.copy()
    for key in [k for k in counted if k[0] == "eager" and k[1] == "graphs='none'"]:
        del counted[key]  # the eager twin's own 7 steps
    assert counted == {
        ("piecewise", "EXTEND 16 -> 16 tokens"): 1,
        ("piecewise", "MIXED 6 -> 8 tokens"): 1,
        ("whole_model", "DECODE bs 3 -> 4"): 1,
        ("piecewise", "DECODE 6 -> 8 tokens; DECODE bs above the largest whole-model graph 4"): 1,
        ("eager", "EXTEND above the largest piecewise size 32"): 1,
        ("piecewise", "MIXED 14 -> 16 tokens"): 1,
        ("eager", "IDLE: no tokens"): 1,
    }
    # The whole-model runner counts its own decline of the bs-6 batch.
    assert counters.eager_fallbacks == {"decode graphs: batch of 6 above the largest captured 4": 1}


def test_the_dispatcher_serves_every_mode_a_whole_model_runner_was_built_for():
    """It asks the runner (padded_bs, modes) instead of naming modes itself:
    TARGET_VERIFY graphs built by hand serve verify steps, and a verify batch
    above their largest size goes to the token graphs."""
    model = _model()
    eager, runner = _runner(model), _captured(model, "breakable")
    TV = sp.ForwardMode.TARGET_VERIFY
    runner.use_graphs(CudaGraphRunner(runner, (1, 2, 4), modes=[D, TV], num_tokens_per_req=3), progress=False)
    counters.reset()
    for i, (mode, prefix) in enumerate([(TV, [5, 9]), (TV, [1, 2, 3, 4, 5, 6]), (E, [4])]):
        extend = [3] * len(prefix)  # 3 draft tokens per verified request
        spec = sp.SpecInfo(num_tokens_per_req=3) if mode == TV else None
        want, got = (_step(r, mode, prefix, extend, seed=i, spec=spec, every_token=True) for r in (eager, runner))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    counters.step_paths.pop(("eager", "graphs='none'"))  # the eager twin's 3 steps
    # bs 2 has a verify graph; bs 6 > 4 runs 18 tokens through breakable graphs of 32.
    assert counters.step_paths == {
        ("whole_model", "TARGET_VERIFY bs 2 -> 2"): 1,
        ("breakable", "TARGET_VERIFY 18 -> 32 tokens; TARGET_VERIFY bs above the largest whole-model graph 4"): 1,
        ("breakable", "EXTEND 3 -> 4 tokens"): 1,
    }


@pytest.mark.parametrize("graphs", ["piecewise", "breakable"])
def test_mixed_batches_through_token_graphs_equal_eager(graphs):
    model = _model()
    eager, runner = _runner(model), _captured(model, graphs)
    counters.reset()
    for i, extend in enumerate(([3, 1, 1, 7], [1, 1, 9], [1, 2], [5, 1, 1, 1, 1, 1])):
        prefix = [(11 * j + i) % 50 for j in range(len(extend))]
        want, got = (_step(r, M, prefix, extend, seed=i) for r in (eager, runner))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # 12, 11, 3 and 10 tokens pad to 16, 16, 4 and 16.
    assert counters.step_paths == {
        ("eager", "graphs='none'"): 4,
        (graphs, "MIXED 12 -> 16 tokens"): 1,
        (graphs, "MIXED 11 -> 16 tokens"): 1,
        (graphs, "MIXED 3 -> 4 tokens"): 1,
        (graphs, "MIXED 10 -> 16 tokens"): 1,
    }


def test_auto_gives_an_untraceable_model_breakable_graphs_and_says_why():
    inner = _model()
    runner = _runner(BranchingModel(inner), "auto")
    report = runner.capture_graphs(progress=False, **CAPTURE)
    assert report.paths["piecewise"].startswith(
        "refused: piecewise graphs: torch.compile: expected a model Dynamo traces as one graph, "
        "got a graph break: Data-dependent branching at "
    )
    assert report.paths["breakable"] == "6 sizes, tokens 1..32"
    assert report.paths["whole_model"] == "3 sizes, bs 1..4, the eager model"
    want = _runner(inner).generate(PROMPTS, 8)
    counters.reset()
    assert runner.generate(PROMPTS, 8) == want
    assert counters.step_paths == {("breakable", "EXTEND 12 -> 16 tokens"): 1, ("whole_model", "DECODE bs 3 -> 4"): 7}


def test_the_piecewise_policy_refuses_an_untraceable_model_naming_the_break():
    runner = _runner(BranchingModel(_model()), "piecewise")
    with pytest.raises(UnsupportedModeError, match=r"graph break: Data-dependent branching at .*test_breakable.py"):
        runner.capture_graphs(progress=False, **CAPTURE)


def test_auto_without_graph_hooks_serves_decode_through_pieces():
    runner = _captured(_model(), "auto", backend="reference")
    counters.reset()
    runner.generate(PROMPTS, 3)
    # 1 prefill of 12 tokens, 2 decode steps of 3 tokens.
    assert counters.step_paths == {("piecewise", "EXTEND 12 -> 16 tokens"): 1, ("piecewise", "DECODE 3 -> 4 tokens"): 2}


def test_full_without_graph_hooks_is_refused_with_the_reason():
    runner = _runner(_model(), "full", backend="reference")
    with pytest.raises(UnsupportedModeError, match="supports_cuda_graph=True"):
        runner.capture_graphs(progress=False, **CAPTURE)


def test_an_unknown_policy_is_refused_naming_the_valid_ones():
    with pytest.raises(InvalidInputError, match=r"graphs: expected one of \['auto', 'full', 'piecewise', "
                                                r"'breakable', 'none'\], got 'fast'"):  # fmt: skip
        _runner(_model(), "fast")


def test_a_piecewise_runner_without_graphs_is_refused():
    with pytest.raises(InvalidInputError, match="options.cudagraphs: expected True"):
        PiecewiseCudaGraphRunner(_runner(_model()), CompileOptions(cudagraphs=False))


def test_steps_before_capture_run_eagerly_and_say_why():
    runner = _runner(_model(), "auto")
    runner.generate([[1, 2]], 2)
    assert counters.step_paths == {("eager", "graphs='auto' not captured yet"): 2}


def test_a_replaced_model_forward_is_counted_as_its_own_path():
    model = _model()
    runner = _runner(model)
    runner.model_forward = lambda ids, positions: model(ids, positions)
    runner.generate([[1, 2]], 2)
    assert counters.step_paths == {("model_forward", "graphs='none'"): 2}


def test_a_runner_handed_to_use_graphs_serves_without_a_policy():
    runner = _runner(_model())
    graphs = CudaGraphRunner(runner, (1, 2, 4))
    assert runner.use_graphs(graphs, progress=False) is graphs and runner.step_graphs is graphs
    runner.generate(PROMPTS, 3)
    assert counters.step_paths == {("eager", "EXTEND: no whole-model graph for this mode"): 1,
                                   ("whole_model", "DECODE bs 3 -> 4"): 2}  # fmt: skip


def test_use_graphs_installs_graphs_captured_already_as_they_are():
    runner = _runner(_model())
    graphs = CudaGraphRunner(runner, (1, 2, 4))
    graphs.capture(progress=False)
    captured = counters.graphs_captured
    runner.use_graphs(graphs, progress=False)
    assert counters.graphs_captured == captured  # no second capture
    runner.generate(PROMPTS, 3)
    assert counters.step_paths[("whole_model", "DECODE bs 3 -> 4")] == 2


@pytest.mark.parametrize("kind", ["whole_model", "piecewise", "breakable"])
def test_a_runner_built_and_captured_but_not_handed_to_use_graphs_serves_no_step(kind):
    """Building a runner installs nothing in the ModelRunner it reads; only
    ``use_graphs`` does."""
    runner = _runner(_model())
    _build(kind, runner).capture(progress=False)
    assert runner.step_graphs is None and runner.token_graphs is None
    counters.reset()
    runner.generate(PROMPTS, 3)
    assert counters.step_paths == {("eager", "graphs='none'"): 3}
    assert [s.path for s in runner.step_stats] == ["eager"] * 3


def _build(kind, runner):
    if kind == "whole_model":
        return CudaGraphRunner(runner, (1, 2, 4))
    if kind == "piecewise":
        options = CompileOptions(cudagraphs=True, capture_sizes=CAPTURE["capture_sizes"], piece_compiler="eager")
        return PiecewiseCudaGraphRunner(runner, options)
    return BreakableCudaGraphRunner(runner, CAPTURE["capture_sizes"])


@pytest.mark.parametrize("kind", ["whole_model", "piecewise", "breakable"])
def test_use_graphs_refuses_graphs_built_for_another_model_runner(kind):
    model = _model()
    runner, other = _runner(model), _runner(model)
    graphs = _build(kind, other)
    with pytest.raises(InvalidInputError, match=r"graphs: expected a \w+ built for this ModelRunner, got one built "
                                                r"for another"):  # fmt: skip
        runner.use_graphs(graphs, progress=False)
    assert runner.step_graphs is None and runner.token_graphs is None
    assert not graphs.captured  # refused before its capture


def test_use_graphs_refuses_what_is_no_graph_runner():
    runner = _runner(_model())
    with pytest.raises(InvalidInputError, match=r"graphs: expected a graph runner \(CudaGraphRunner, .*\), got dict"):
        runner.use_graphs({"model_runner": runner})
    with pytest.raises(AttributeError):  # read-only: use_graphs is the one way in
        runner.step_graphs = CudaGraphRunner(runner, (1, 2, 4))


def test_a_capture_that_fails_leaves_the_installed_graphs_serving():
    """A model Dynamo cannot trace keeps its breakable graphs when a
    piecewise capture is refused: nothing of the failed runner is installed."""
    inner = _model()
    runner = _runner(BranchingModel(inner))
    breakable = runner.use_graphs(_build("breakable", runner), progress=False)
    with pytest.raises(UnsupportedModeError, match="piecewise graphs: .*graph break"):
        runner.use_graphs(_build("piecewise", runner), progress=False)
    assert runner.token_graphs is breakable
    want = _runner(inner).generate(PROMPTS, 3)
    counters.reset()
    assert runner.generate(PROMPTS, 3) == want
    assert counters.step_paths == {("breakable", "EXTEND 12 -> 16 tokens"): 1, ("breakable", "DECODE 3 -> 4 tokens"): 2}


def test_whole_model_batch_sizes_default_alike_under_a_policy_and_by_hand():
    """Both include a full request table (10, off the schedule) as a size of its own."""
    model = _model()
    runner = _runner(model, "full", max_reqs=10)
    runner.capture_graphs(progress=False, capture_sizes=CAPTURE["capture_sizes"])
    by_hand = CudaGraphRunner(_runner(model, max_reqs=10))
    assert list(runner.step_graphs.capture_bs) == list(by_hand.capture_bs) == [1, 2, 4, 8, 10]


def test_auto_compiles_at_capture_so_the_first_generate_compiles_nothing():
    """The whole-model graphs run their forward once per size before capture,
    on a CPU too: their compiled forward compiles there, not at the first decode."""
    runner = _captured(_model(), "auto")
    compiled = (counters.graphs_split, counters.pieces_seen, counters.pieces_compiled)
    runner.generate(PROMPTS, 4)
    assert (counters.graphs_split, counters.pieces_seen, counters.pieces_compiled) == compiled


def test_piecewise_steps_of_any_token_count_never_recompile():
    runner = _captured(_model(), "piecewise")
    torch.compiler.set_stance("fail_on_recompile")
    try:  # token counts 1 (one prompt decoding), 2, 3 and prefills of 1, 4 and 12
        for prompts in ([[5]], [[1, 2, 3, 4]], [[1], [2]], PROMPTS):
            runner.generate(prompts, 3)
    finally:
        torch.compiler.set_stance("default")
    assert counters.graphs_split == 1


def test_step_paths_print_as_totals_per_path_and_reasons_most_first():
    counters.step_paths.update({("whole_model", "DECODE bs 3 -> 4"): 7, ("piecewise", "EXTEND 12 -> 16 tokens"): 1,
                                ("eager", "EXTEND above the largest piecewise size 32"): 2})  # fmt: skip
    assert counters.format_step_paths() == (
        "10 steps\n"
        "  whole_model         7   70.0%\n"
        "            7  DECODE bs 3 -> 4\n"
        "  eager               2   20.0%\n"
        "            2  EXTEND above the largest piecewise size 32\n"
        "  piecewise           1   10.0%\n"
        "            1  EXTEND 12 -> 16 tokens"
    )
    counters.reset()
    assert counters.format_step_paths() == "no steps counted"
    assert counters.as_dict()["step_paths"] == {}


# ---- GPU: real CUDA graphs ----------------------------------------------------
GPU_CONFIG = ModelConfig(**{**CONFIG.__dict__, "head_dim": 64, "hidden_size": 256})
RAGGED_PROMPT_LENS = (1, 3, 7, 12, 20, 33, 50)  # 126 tokens


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", POLICIES)
@pytest.mark.parametrize("backend", ["torch", "triton", "flashinfer"])
def test_gpu_every_policy_generates_the_eager_tokens_for_7_ragged_prompts(backend, graphs):
    """64 greedy tokens; fp32 (flashinfer: bf16, its prefill kernels take
    16-bit inputs only, and pieces compiled by "eager": Inductor's fused
    kernels round differently from eager in bf16)."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    dtype = torch.bfloat16 if backend == "flashinfer" else torch.float32
    compiler = "eager" if backend == "flashinfer" else "inductor"
    model = _model("cuda", dtype, GPU_CONFIG)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in RAGGED_PROMPT_LENS]
    want = _runner(model, backend=backend, max_context_len=128).generate(prompts, 64)
    runner = _runner(model, graphs, backend, max_context_len=128)
    runner.capture_graphs(progress=False, capture_sizes=(1, 2, 4, 8, 16, 32, 64, 128), piece_compiler=compiler)
    counters.reset()
    assert runner.generate(prompts, 64) == want
    paths = collections.Counter(s.path for s in runner.step_stats)
    # 1 prefill of 126 tokens (pads to 128), 63 decode steps of bs 7 (pads to 8).
    expected = {"auto": {"piecewise": 1, "whole_model": 63}, "full": {"eager": 1, "whole_model": 63},
                "piecewise": {"piecewise": 64}, "breakable": {"breakable": 64}, "none": {"eager": 64}}  # fmt: skip
    assert paths == expected[graphs]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_whole_model_decode_steps_of_generate_never_synchronise(backend):
    """Every decode step is queued before the one before it is read: a run of
    20 tokens makes no more synchronising CUDA calls than a run of 2."""
    model = _model("cuda", torch.float32, GPU_CONFIG)
    runner = _runner(model, "full", backend, max_context_len=64)
    runner.capture_graphs(progress=False, capture_sizes=(1, 2, 4, 8))
    prompts = [[3, 1, 4], [1, 5]]
    runner.generate(prompts, 2)  # warm: first calls may set things up

    def syncs(new_tokens: int) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                runner.generate(prompts, new_tokens)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchronizing" in str(w.message) for w in caught)

    short, long = syncs(2), syncs(20)
    assert long == short
    assert collections.Counter(s.path for s in runner.step_stats)["whole_model"] == 19


@pytest.mark.triton_cpu
@pytest.mark.parametrize("graphs", ["piecewise", "breakable"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_runners_with_eager_attention_reserve_bindings_where_the_backend_fills_eager_steps_there(graphs, backend):
    """Piecewise and breakable graphs run attention eagerly every step: the
    triton backend gets static buffers for their steps (up to the largest
    capture size's tokens, as many requests as the request table holds), so
    those steps fill a binding; the torch backend, which fills fresh tensors,
    gets none. Tokens stay the eager ones."""
    model = _model()
    eager = _runner(model).generate(PROMPTS, 4)
    runner = _captured(model, graphs, backend)
    if backend == "torch":
        assert runner.backend.cuda_graph_buffers() == {}
    else:
        assert (runner.backend.max_bs, runner.backend.max_num_tokens) == (8, 32)  # min(max_reqs, 32), 32
    assert runner.generate(PROMPTS, 4) == eager
    meta, buffers = runner.backend.forward_metadata, runner.backend.cuda_graph_buffers()
    in_buffers = any(b.data_ptr() <= meta.kv_indptr.data_ptr() < b.data_ptr() + b.nbytes for b in buffers.values())
    assert in_buffers == (backend == "triton")
