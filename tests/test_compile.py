"""The ``sgl_piecewise`` Dynamo backend on the CPU: splitting, piece
compilation and sharing, token padding through the registry, capture as a
pass-through, counters, recompile-freedom, and equality with eager."""

import pytest
import torch

import sgl_piecewise as sp
from sgl_piecewise.backends import ReferenceBackend
from sgl_piecewise.compile import CompiledModel, CompileOptions, counters, default_capture_sizes, register_splitting_op
from sgl_piecewise.compile.piece_graphs import Phase, PieceGraphs, StaticInputsMoved, StepState, _Entry
from sgl_piecewise.compile.split import split_graph, to_out_variant
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.engine.testing import random_batch
from sgl_piecewise.errors import InvalidInputError, SglPiecewiseError
from sgl_piecewise.models import ModelConfig, build_random_model
from sgl_piecewise.runners.piecewise import PiecewiseCudaGraphRunner

LAYERS = 3


def tiny_config(arch: str) -> ModelConfig:
    return ModelConfig(
        architecture=arch,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
        tie_word_embeddings=arch == "Qwen2ForCausalLM",
        qkv_bias=arch == "Qwen2ForCausalLM",
    )


FAMILIES = ["LlamaForCausalLM", "Qwen2ForCausalLM"]


# Each compile here adds a Dynamo cache entry for the same model code; entries
# left by other tests must not push it past the recompile limit.
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def model_and_pools(arch="LlamaForCausalLM"):
    model = build_random_model(tiny_config(arch), seed=1)
    table = sp.ReqToTokenPool(max_reqs=16, max_context_len=256)
    pool = sp.KVPool(4096, LAYERS, 2, 16)
    return model, ReferenceBackend(table, pool)


def step(model_fn, backend, prefix, extend, vocab_size=256):
    """One EXTEND step of a fresh random batch; returns the hidden states."""
    batch = random_batch(
        sp.ForwardMode.EXTEND, backend.req_to_token_pool, backend.kv_pool, prefix, extend, vocab_size=vocab_size
    )
    backend.init_forward_metadata(batch)
    with torch.no_grad(), sp.forward_context(batch, backend):
        return batch, model_fn(batch.input_ids, batch.positions)


@pytest.mark.parametrize("arch", FAMILIES)
def test_shipped_models_trace_without_graph_breaks(arch):
    model, backend = model_and_pools(arch)
    batch = random_batch(
        sp.ForwardMode.EXTEND, backend.req_to_token_pool, backend.kv_pool, [0, 3], [4, 2], vocab_size=256
    )
    backend.init_forward_metadata(batch)
    with torch.no_grad(), sp.forward_context(batch, backend):
        explanation = torch._dynamo.explain(model)(batch.input_ids, batch.positions)
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1


@pytest.mark.parametrize("arch", FAMILIES)
def test_no_recompile_when_the_token_count_changes(arch):
    model, backend = model_and_pools(arch)
    compiled = CompiledModel(model, CompileOptions(piece_compiler="eager"))
    sizes = [7, 1, 3, 12, 5, 2]
    for i, n in enumerate(sizes):
        if i == 1:  # the first call compiles; no later size may
            torch.compiler.set_stance("fail_on_recompile")
        try:
            batch, got = step(compiled, backend, [i], [n])
        finally:
            torch.compiler.set_stance("default")
        with torch.no_grad(), sp.forward_context(batch, backend):
            want = model(batch.input_ids, batch.positions)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counters.graphs_split == 1
    # The one trace bound the token count only from below: its shape guards
    # were dropped, so 1 token ran the same graph.
    assert compiled.token_guards.dropped == 1 and compiled.token_guards.kept_reason is None


def test_counters_count_pieces_captures_replays_and_fallbacks():
    model, backend = model_and_pools()
    compiled = CompiledModel(model, CompileOptions(cudagraphs=True, capture_sizes=(4, 8), piece_compiler="eager"))
    for n in (3, 4, 6, 9):
        step(compiled, backend, [0], [n])
    # 3 attention ops split the model into 4 compiled pieces: before layer 0's
    # attention, two identical "o_proj .. next qkv" middles, and the tail.
    assert counters.pieces_seen == 4
    assert counters.pieces_compiled == 3  # the two middles share one artifact
    # n=3 pads to 4 and captures 4 pieces; n=4 replays them; n=6 pads to 8 and
    # captures 4 more; n=9 is above 8 and runs without graphs.
    assert counters.graphs_captured == 8
    assert counters.replays == 4
    assert dict(counters.eager_fallbacks) == {"9 tokens: above the largest capture size 8": 1}


class _LastLayersSummed(torch.nn.Module):
    """A decoder whose output adds the last three layers' hidden states: the
    tail piece reads the outputs of two identical middle pieces."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, positions):
        m = self.inner.model
        x, hidden = m.embed_tokens(input_ids), []
        for layer in m.layers:
            x = layer(positions, x, m.rotary_emb)
            hidden.append(x)
        return m.norm(hidden[-1]) + hidden[-2] + hidden[-3]


@pytest.mark.parametrize("skip_connection", [False, True])
def test_the_compile_fake_runs_each_distinct_piece_once(monkeypatch, skip_connection):
    """Identical pieces have outputs of the same metadata: the compile's fake
    run of the split module runs the shared middle piece once, and the
    compiled model still equals eager. Not so where a piece reads two
    identical pieces' outputs: shared, they would be one tensor to it."""
    import torch.fx

    ran = []
    fake_run = torch.fx.Interpreter.call_module

    def counted(self, target, args, kwargs):
        ran.append(target)
        return fake_run(self, target, args, kwargs)

    monkeypatch.setattr(torch.fx.Interpreter, "call_module", counted)
    model, backend = model_and_pools()
    model = _LastLayersSummed(model) if skip_connection else model
    compiled = CompiledModel(model, CompileOptions(piece_compiler="eager"))
    batch, out = step(compiled, backend, [0, 3], [5, 2])
    monkeypatch.undo()
    # 4 compiled pieces (first, two identical middles, tail) around 3
    # attention pieces: the second middle is not run, unless the tail reads
    # both middles.
    assert counters.pieces_seen == 4 and counters.pieces_compiled == 3
    assert len(set(ran)) == len(ran) == (7 if skip_connection else 6), ran
    backend.init_forward_metadata(batch)
    with torch.no_grad(), sp.forward_context(batch, backend):
        want = model(batch.input_ids, batch.positions)
    torch.testing.assert_close(out, want)


@torch.library.custom_op("sgl_piecewise_test::dispatch_probe", mutates_args=())
def _dispatch_probe(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


_PROBED: list = []  # per fake call: was the Python dispatcher on?


@_dispatch_probe.register_fake
def _dispatch_probe_fake(x):
    _PROBED.append(torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher))
    return torch.empty_like(x)


class _Probed(torch.nn.Module):
    def forward(self, input_ids, positions):
        return torch.ops.sgl_piecewise_test.dispatch_probe(input_ids.float()[:, None] * 2) + positions[:, None]


def test_the_compile_fake_runs_the_pieces_under_the_python_dispatcher_as_dynamo_traced_them():
    """Without it, a C++ composite reading a size as an int (on CUDA: the
    float32 matmul of transformers' rotary embedding) fixes the token count
    the trace left symbolic, and the compile fails its own dynamic axis."""
    _PROBED.clear()
    compiled = CompiledModel(_Probed(), CompileOptions(piece_compiler="eager", cudagraphs=False))
    out = compiled(torch.arange(5), torch.arange(5))
    assert out.shape == (5, 1)
    assert _PROBED == [True, True]  # Dynamo's trace, then the compile's fake run


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("piece_compiler", ["eager", "inductor"])
def test_graphed_generation_equals_eager_over_changing_batches(arch, piece_compiler):
    """Prefill of a ragged batch, then decode steps: padded token counts change every step."""
    model = build_random_model(tiny_config(arch), seed=2)
    prompts = [[5, 9, 2, 7, 1], [3], [8, 8, 1, 4, 4, 4, 2, 9, 9, 10, 11]]
    eager = ModelRunner(model, max_reqs=4, max_context_len=64).generate(prompts, 6)
    runner = ModelRunner(model, max_reqs=4, max_context_len=64)
    options = CompileOptions(
        cudagraphs=True, capture_sizes=(1, 2, 4, 8, 16, 32), piece_compiler=piece_compiler, debug_checks=True
    )
    runner.use_graphs(PiecewiseCudaGraphRunner(runner, options), progress=False)
    assert runner.generate(prompts, 6) == eager
    assert counters.graphs_captured == 6 * counters.pieces_seen
    assert counters.replays > 0 and not counters.eager_fallbacks


def test_padded_logits_equal_unpadded_logits():
    model, backend = model_and_pools()
    compiled = CompiledModel(model, CompileOptions(cudagraphs=True, capture_sizes=(16,), piece_compiler="eager"))
    batch, got = step(compiled, backend, [2, 0], [5, 6])  # 11 tokens padded to 16
    with torch.no_grad(), sp.forward_context(batch, backend):
        want = model(batch.input_ids, batch.positions)
    assert got.shape == want.shape == (11, 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class CrossTokenLeak(torch.nn.Module):
    """A deliberately wrong model: after attention it sums the residual stream
    over every row, padded rows included, into each row."""

    def forward(self, input_ids, positions):
        h = torch.nn.functional.one_hot(input_ids, 8).float()  # [T, 8]
        q = h.view(-1, 2, 4)
        a = sp.ops.unified_attention(q, q[:, :1], q[:, :1], layer_id=0)
        return a.flatten(1) + h.sum(0)


def test_nan_poison_reveals_a_leak_of_padded_rows():
    table = sp.ReqToTokenPool(4, 64)
    backend = ReferenceBackend(table, sp.KVPool(64, 1, 1, 4))
    options = CompileOptions(cudagraphs=True, capture_sizes=(8,), piece_compiler="eager", debug_checks=True)
    compiled = CompiledModel(CrossTokenLeak(), options)
    _, out = step(compiled, backend, [0], [5], vocab_size=8)
    assert torch.isnan(out).all()


def test_debug_check_rejects_an_input_that_moved_since_capture():
    """An earlier piece's output (not a static input) must come from the
    pool at its captured address: debug_checks names one that did not."""
    state = StepState(debug_checks=True, use_cuda=True, phase=Phase.REPLAY, num_tokens=4, padded_tokens=4)
    piece = PieceGraphs("submod_0", lambda x: x * 2, state, static_args=[False])
    captured, moved = torch.ones(4), torch.ones(4)  # both alive: distinct addresses
    piece.entries[state.replay_key] = _Entry(input_ptrs=[captured.data_ptr()])  # as a capture on a GPU leaves it
    piece(captured)  # the same input replays fine
    with pytest.raises(SglPiecewiseError, match=r"graph inputs \[0\] moved since capture"):
        piece(moved)


def test_a_static_input_at_a_new_address_stops_the_replay_before_it_runs():
    state = StepState(phase=Phase.CAPTURE, num_tokens=4, padded_tokens=4)
    ran = []
    piece = PieceGraphs("submod_0", lambda w, x: ran.append(1) or x * w, state, static_args=[True, False])
    weight, x = torch.ones(4), torch.ones(4)
    piece(weight, x)
    state.phase = Phase.REPLAY
    piece(weight, x)
    assert len(ran) == 2
    with pytest.raises(StaticInputsMoved, match="submod_0: expected its static inputs .* graph set 0"):
        piece(torch.ones(4), x)
    assert len(ran) == 2


def test_unknown_options_are_rejected_with_the_valid_keys():
    model, backend = model_and_pools()
    compiled = torch.compile(model, backend="sgl_piecewise", options={"capture_size": [4]})
    with pytest.raises(Exception, match=r"expected keys among \[.*'capture_sizes'.*\], got unknown \['capture_size'\]"):
        step(compiled, backend, [0], [3])


def test_reduce_overhead_mode_turns_graphs_on():
    assert CompileOptions.from_compile_args("reduce-overhead", None).cudagraphs
    assert not CompileOptions.from_compile_args(None, None).cudagraphs
    with pytest.raises(InvalidInputError, match="mode: expected one of"):
        CompileOptions.from_compile_args("max-speed", None)


def test_default_capture_sizes_follow_the_sglang_schedule():
    sizes = default_capture_sizes(512)
    assert sizes[:8] == (1, 2, 4, 8, 12, 16, 24, 32)
    assert sizes[-3:] == (480, 496, 512)
    assert CompileOptions(capture_sizes=(8, 2, 8)).capture_sizes == (2, 8)
    assert CompileOptions(capture_sizes=(2, 8)).padded_size(3) == 8
    assert CompileOptions(capture_sizes=(2, 8)).padded_size(9) is None


@torch.library.custom_op("sgl_piecewise_test::host_step", mutates_args=())
def host_step(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@host_step.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_registered_op_splits_the_graph_too():
    def f(x):
        return host_step(x.sin()).cos()

    gm = torch.fx.symbolic_trace(f)
    _, before = split_graph(gm)
    register_splitting_op(torch.ops.sgl_piecewise_test.host_step)
    gm = torch.fx.symbolic_trace(f)
    _, after = split_graph(gm)
    assert [p.is_splitting_op for p in before] == [False]
    assert [p.is_splitting_op for p in after] == [False, True, False]


def test_functional_attention_becomes_the_out_variant():
    model, backend = model_and_pools()
    seen = {}

    def inspect(gm, example_inputs):
        seen["rewritten"] = to_out_variant(gm)
        seen["targets"] = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        return gm.forward

    step(torch.compile(model, backend=inspect), backend, [0], [4])
    assert seen["rewritten"] == LAYERS
    assert "sgl_piecewise.unified_attention_with_output.default" in seen["targets"]
    assert "sgl_piecewise.unified_attention" not in seen["targets"]


def test_capture_freezes_gc_even_if_others_froze_first_and_nests(monkeypatch):
    import gc

    from sgl_piecewise.graphs.capture import frozen_gc

    # Frozen objects that die leave the frozen set (another thread's garbage
    # may), so the count cannot show that nothing was thawed: thaws are watched.
    thaws = []
    unfreeze = gc.unfreeze
    monkeypatch.setattr(gc, "unfreeze", lambda: (thaws.append(True), unfreeze()))
    gc.freeze()  # someone else's freeze (Inductor's compile-worker pool does this)
    try:
        before = gc.get_freeze_count()
        fresh = [[] for _ in range(100)]  # created after that freeze
        with frozen_gc():
            outer = gc.get_freeze_count()
            assert outer >= before + len(fresh)  # the capture froze them too
            with frozen_gc():
                pass
            assert thaws == []  # the inner exit thawed nothing
        # The outer exit leaves the caller's freeze in place.
        assert thaws == [] and gc.get_freeze_count() >= before
    finally:
        unfreeze()


def test_capture_thaws_on_exit_what_it_froze_when_nothing_was_frozen_before():
    import gc

    from sgl_piecewise.graphs.capture import frozen_gc

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    with frozen_gc():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_attention_between_pieces_skips_the_dispatcher():
    from sgl_piecewise.compile import SglPiecewiseBackend
    from sgl_piecewise.ops.attention import attention_with_output_direct

    model, backend = model_and_pools()
    sgl_backend = SglPiecewiseBackend(piece_compiler="eager")
    batch, got = step(torch.compile(model, backend=sgl_backend), backend, [1], [5])
    with torch.no_grad(), sp.forward_context(batch, backend):
        want = model(batch.input_ids, batch.positions)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    (module,) = sgl_backend.modules
    attention = [p for p in module.pieces if p.is_splitting_op]
    targets = [n.target for p in attention for n in p.graph.graph.nodes if n.op == "call_function"]
    assert targets == [attention_with_output_direct] * LAYERS
