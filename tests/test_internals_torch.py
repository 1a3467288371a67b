"""``sgl_piecewise/internals``, torch side: every module finds what it uses
on the installed torch (a torch upgrade that breaks one fails here), and
each one's fallback, forced by setting its ``AVAILABLE`` to False, still
gives correct results."""

import importlib
import logging

import pytest
import torch

import sgl_piecewise as sp
from sgl_piecewise.backends import ReferenceBackend
from sgl_piecewise.compile import CompiledModel, CompileOptions, counters, piece_compiler
from sgl_piecewise.engine.testing import random_batch, two_layer_llama_config
from sgl_piecewise.errors import SglPiecewiseError, UnsupportedModeError
from sgl_piecewise.graphs.capture import GraphCapture
from sgl_piecewise.internals import (
    cuda_graph_pool,
    dynamo_backend,
    dynamo_trace,
    fake_tensor,
    inductor,
    size_oblivious,
    storage_alias,
)
from sgl_piecewise.models import build_random_model

TORCH_MODULES = [
    "storage_alias", "cuda_graph_pool", "size_oblivious", "dynamo_trace", "dynamo_backend", "inductor", "fake_tensor",
    "foreach_copy",
]  # fmt: skip


@pytest.mark.parametrize("name", TORCH_MODULES)
def test_every_torch_internal_is_available_on_the_installed_torch(name):
    module = importlib.import_module(f"sgl_piecewise.internals.{name}")
    if name == "cuda_graph_pool" and not torch.backends.cuda.is_built():
        pytest.skip("a torch built without CUDA has no cuBLAS workspaces (and captures nothing)")
    assert module.AVAILABLE, module.UNAVAILABLE_REASON
    assert module.UNAVAILABLE_REASON == ""
    assert module.TORCH_VERSIONS == ("2.11", "2.13")
    assert module.__doc__ and "2.11-2.13" in module.__doc__


# ---- storage_alias --------------------------------------------------------------
def _same_view(alias: torch.Tensor, t: torch.Tensor) -> None:
    assert alias.data_ptr() == t.data_ptr()
    assert (alias.shape, alias.stride(), alias.storage_offset(), alias.dtype) == (
        t.shape,
        t.stride(),
        t.storage_offset(),
        t.dtype,
    )
    torch.testing.assert_close(alias, t)


@pytest.mark.parametrize("available", [True, False])
def test_an_alias_is_the_same_memory_and_values_with_or_without_the_internal(monkeypatch, available):
    monkeypatch.setattr(storage_alias, "AVAILABLE", available)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    t = base[1:, ::2]  # an offset and strides of its own
    alias = storage_alias.non_owning_alias(t)
    _same_view(alias, t)
    t.mul_(2)  # one memory: a write through either shows in both
    torch.testing.assert_close(alias, t)


def test_the_fallback_alias_keeps_its_memory_alive(monkeypatch):
    monkeypatch.setattr(storage_alias, "AVAILABLE", False)
    t = torch.arange(8.0)
    alias = storage_alias.non_owning_alias(t)
    weak = t.untyped_storage()._weak_ref()
    del t
    assert not torch.UntypedStorage._expired(weak)  # still held, by the alias
    torch.testing.assert_close(alias, torch.arange(8.0))


@pytest.mark.gpu
@pytest.mark.parametrize("available", [True, False])
def test_gpu_aliased_graph_outputs_are_replayed_right_with_or_without_the_internal(monkeypatch, available):
    monkeypatch.setattr(storage_alias, "AVAILABLE", available)
    core = GraphCapture("cuda")
    x = torch.randn(64, 64, device="cuda")
    core.warmup(lambda: (x @ x).relu())
    graph, out = core.record(lambda: (x @ x).relu())
    alias = storage_alias.non_owning_alias(out)
    del out
    x.copy_(torch.randn(64, 64, device="cuda"))
    graph.replay()
    torch.testing.assert_close(alias, (x @ x).relu())


# ---- cuda_graph_pool ------------------------------------------------------------
def test_without_the_cublas_call_the_capture_warns_once_and_skips(monkeypatch, caplog):
    monkeypatch.setattr(cuda_graph_pool, "AVAILABLE", False)
    monkeypatch.setattr(cuda_graph_pool, "UNAVAILABLE_REASON", "forced by a test")
    monkeypatch.setattr(cuda_graph_pool, "_warned", False)
    monkeypatch.setattr(cuda_graph_pool, "_clear", None)  # would raise if called
    monkeypatch.setattr(cuda_graph_pool, "_end", None)
    with caplog.at_level(logging.WARNING, logger="sgl_piecewise.graphs"):
        cuda_graph_pool.clear_cublas_workspaces()
        cuda_graph_pool.clear_cublas_workspaces()
        cuda_graph_pool.end_allocate_to_pool(0, (0, 1))
    warnings = [r for r in caplog.records if "cuBLAS workspaces not freed" in r.getMessage()]
    assert len(warnings) == 1 and "forced by a test" in warnings[0].getMessage()
    assert "reduce-overhead" in warnings[0].getMessage()


@pytest.mark.gpu
def test_gpu_without_the_pool_internals_graphs_still_capture_replay_and_recover(monkeypatch):
    """The cuBLAS workspaces stay where the warm-up put them and a failed
    capture's pool is not closed: matmul graphs still replay right, and
    after a capture CUDA invalidated, later ones go to a new pool."""
    monkeypatch.setattr(cuda_graph_pool, "AVAILABLE", False)
    monkeypatch.setattr(cuda_graph_pool, "_warned", True)
    core = GraphCapture("cuda")
    x = torch.randn(256, 256, device="cuda")
    step = lambda: (x @ x).relu()  # noqa: E731
    core.warmup(step)
    graph, out = core.record(step)
    x.copy_(torch.randn(256, 256, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, step())

    def unchecked_sync():
        torch.cuda.set_sync_debug_mode("default")
        return (x * 2).sum().item()

    old_pool = core.pool
    try:
        with pytest.raises(RuntimeError):
            core.record(unchecked_sync)
        assert core.pool != old_pool
        graph, out = core.record(lambda: x * 3)
        graph.replay()
        torch.testing.assert_close(out, x * 3)
    finally:
        # Close the old pool's record after all: left open, the allocator
        # releases nothing on empty_cache() for the rest of the process
        # (the fallback's cost), which later tests measure.
        cuda_graph_pool._end(core.device.index, old_pool)


# ---- size_oblivious ---------------------------------------------------------------
def _llama_and_backend():
    model = build_random_model(two_layer_llama_config(), seed=1)
    backend = ReferenceBackend(sp.ReqToTokenPool(max_reqs=8, max_context_len=64), sp.KVPool(512, 2, 2, 16))
    return model, backend


def _step_equals_eager(compiled, model, backend, n):
    batch = random_batch(sp.ForwardMode.EXTEND, backend.req_to_token_pool, backend.kv_pool, [0], [n], vocab_size=256)
    backend.init_forward_metadata(batch)
    with torch.no_grad(), sp.forward_context(batch, backend):
        got = compiled(batch.input_ids, batch.positions)
        want = model(batch.input_ids, batch.positions)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("piece_compiler", ["eager", "inductor"])
def test_without_size_oblivious_tracing_the_unbacked_axis_equals_eager_and_never_recompiles(
    monkeypatch, piece_compiler
):
    monkeypatch.setattr(size_oblivious, "AVAILABLE", False)
    monkeypatch.setattr(size_oblivious, "UNAVAILABLE_REASON", "forced by a test")
    monkeypatch.setattr(size_oblivious, "_fx_config", None)  # the setting is not touched: any use would raise
    model, backend = _llama_and_backend()
    compiled = CompiledModel(model, CompileOptions(piece_compiler=piece_compiler))
    try:
        for i, n in enumerate((5, 1, 3, 9)):
            if i == 1:
                torch.compiler.set_stance("fail_on_recompile")
            _step_equals_eager(compiled, model, backend, n)
    finally:
        torch.compiler.set_stance("default")
    assert counters.graphs_split == 1
    # Dynamo's shape guards (equal lengths, the traced bound) are kept unread: it checks them per call.
    assert compiled.token_guards.dropped == 0 and "forced by a test" in compiled.token_guards.kept_reason


# ---- dynamo_trace -------------------------------------------------------------------
class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, ids, positions):
        return self.proj(self.embed(ids)) + positions[:, None]


def _toy_options(cache_dir):
    return CompileOptions(cudagraphs=True, capture_sizes=(2, 4), piece_compiler="eager", cache_dir=str(cache_dir))


def _toy_call(compiled, n):
    ids, positions = torch.arange(n) % 50, torch.arange(n, dtype=torch.float32)
    return compiled(ids, positions), (ids, positions)


def _count_dynamo_calls(compiled: CompiledModel) -> list:
    calls, through_dynamo = [], compiled.compiled
    compiled.compiled = lambda *args: calls.append(args[0].shape[0]) or through_dynamo(*args)
    return calls


@pytest.mark.usefixtures("fresh_dynamo")
@torch.no_grad()
def test_without_the_trace_internals_nothing_is_saved_and_every_call_compiles_through_dynamo(
    monkeypatch, tmp_path, caplog
):
    monkeypatch.setattr(dynamo_trace, "AVAILABLE", False)
    monkeypatch.setattr(dynamo_trace, "UNAVAILABLE_REASON", "forced by a test")
    model = Toy()
    for _ in range(2):  # a second CompiledModel finds nothing saved: it traces again
        compiled = CompiledModel(model, _toy_options(tmp_path))
        calls = _count_dynamo_calls(compiled)
        with caplog.at_level(logging.INFO, logger="sgl_piecewise.compile"):
            for n in (3, 1, 4):
                out, args = _toy_call(compiled, n)
                torch.testing.assert_close(out, model(*args))
        assert calls == [3, 1, 4]  # every call through Dynamo: none without its guards
    assert "forced by a test" in caplog.text and "compile not saved" in caplog.text
    assert counters.compiles_saved == 0 and counters.compiles_loaded == 0
    assert not list(tmp_path.glob("graph-*/entry.pkl"))


@pytest.mark.usefixtures("fresh_dynamo")
@torch.no_grad()
def test_a_compile_saved_with_the_trace_internals_loads_and_equals_eager(tmp_path):
    """The other half: with them, the compile is saved, and a new
    CompiledModel starts from it without tracing."""
    model = Toy()
    _toy_call(CompiledModel(model, _toy_options(tmp_path)), 3)
    assert counters.compiles_saved == 1
    warm = CompiledModel(model, _toy_options(tmp_path))
    for n in (3, 1):
        out, args = _toy_call(warm, n)
        torch.testing.assert_close(out, model(*args))
    assert counters.compiles_loaded == 1 and counters.graphs_split == 1


def test_the_trace_internals_raise_a_readable_error_when_unavailable(monkeypatch):
    monkeypatch.setattr(dynamo_trace, "AVAILABLE", False)
    monkeypatch.setattr(dynamo_trace, "UNAVAILABLE_REASON", "forced by a test")
    for read in (dynamo_trace.traced_code, dynamo_trace.mutated_existing_objects):
        with pytest.raises(dynamo_trace.TraceUnreadable, match="forced by a test"):
            read()


# ---- dynamo_backend and inductor: no fallback, a clear error ------------------------
class BreaksTheGraph(torch.nn.Module):
    def forward(self, ids, positions):
        if ids.sum() > 0:  # a branch on a tensor's value
            return positions * 2
        return positions


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("known", [True, False])
def test_a_graph_break_is_explained_where_dynamo_names_it_and_raised_as_dynamo_s_where_not(monkeypatch, known):
    if not known:
        monkeypatch.setattr(dynamo_backend, "GraphBreak", ())
    compiled = CompiledModel(BreaksTheGraph(), CompileOptions(piece_compiler="eager"))
    args = (torch.arange(3), torch.arange(3, dtype=torch.float32))
    with pytest.raises(Exception) as raised:
        compiled(*args)
    if known:
        assert isinstance(raised.value, UnsupportedModeError) and "graph break" in str(raised.value)
    else:  # Dynamo's own error, uncaught
        assert not isinstance(raised.value, UnsupportedModeError) and "Data-dependent" in str(raised.value)


def test_without_the_backend_entry_points_the_error_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(dynamo_backend, "_detect_fake_mode", None)
    monkeypatch.setattr(dynamo_backend, "_lookup_backend", None)
    monkeypatch.setattr(dynamo_backend, "UNAVAILABLE_REASON", "forced by a test")
    with pytest.raises(SglPiecewiseError, match="fake mode in torch, got none \\(forced by a test\\)"):
        dynamo_backend.detect_fake_mode()
    with pytest.raises(SglPiecewiseError, match="backend registry"):
        dynamo_backend.lookup_backend("tensorrt")


def test_without_inductor_s_entry_points_an_inductor_piece_says_so(monkeypatch):
    monkeypatch.setattr(inductor, "AVAILABLE", False)
    monkeypatch.setattr(inductor, "UNAVAILABLE_REASON", "forced by a test")
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(SglPiecewiseError, match="piece_compiler='inductor'.*forced by a test.*'eager'"):
        piece_compiler.PieceCompiler("inductor")(gm, [torch.ones(2)])


def test_fake_tensor_fallback_counts_every_tensor_as_fake(monkeypatch):
    """Without torch's ``is_fake`` the attention op's fake implementation
    checks nothing against the pool: a plain meta tensor then counts as fake,
    a shape computation, as on a torch without the check."""
    plain = torch.empty(2, 3, device="meta")
    assert not fake_tensor.is_fake(plain)
    monkeypatch.setattr(fake_tensor, "AVAILABLE", False)
    assert fake_tensor.is_fake(plain)
