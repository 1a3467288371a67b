"""Repeated regions (``sgl_piecewise/regions.py``): a layer's code between
its attention calls traced once and stamped out for the other layers, the
backend given the same flat graph as without regions, on the CPU."""

import threading

import pytest
import torch

import sgl_piecewise as sp
from sgl_piecewise import regions
from sgl_piecewise.backends import ReferenceBackend
from sgl_piecewise.compile import CompiledModel, CompileOptions
from sgl_piecewise.compile import backend as compile_backend
from sgl_piecewise.engine.testing import random_batch
from sgl_piecewise.errors import InvalidTypeError
from sgl_piecewise.models import ModelConfig, build_random_model

LAYERS = 4

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
needs_reuse = pytest.mark.skipif(
    not regions.regions_available(), reason=f"torch {torch.__version__}: Dynamo re-traces every region call"
)


def model_and_backend():
    config = ModelConfig(architecture="Qwen2ForCausalLM", hidden_size=64, intermediate_size=128,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         max_position_embeddings=256, tie_word_embeddings=True, qkv_bias=True)  # fmt: skip
    model = build_random_model(config, seed=1)
    return model, ReferenceBackend(sp.ReqToTokenPool(max_reqs=8, max_context_len=256), sp.KVPool(2048, LAYERS, 2, 16))


def step(compiled, model, backend, extend):
    """(compiled, eager) hidden states of one extend step of fresh requests."""
    batch = random_batch(sp.ForwardMode.EXTEND, backend.req_to_token_pool, backend.kv_pool, [0] * len(extend),
                         extend, vocab_size=256)  # fmt: skip
    backend.init_forward_metadata(batch)
    with torch.no_grad(), sp.forward_context(batch, backend):
        return compiled(batch.input_ids, batch.positions), model(batch.input_ids, batch.positions)


def traced_graph(monkeypatch, with_regions: bool, **options):
    """(ops of the graph the backend got, in order; hidden states; eager's;
    the compile's constant guards) of one compiled extend step. Piecewise
    graphs (a pass-through on the CPU): later calls skip Dynamo, the case
    where regions are traced."""
    if not with_regions:
        monkeypatch.setattr(regions, "regions_available", lambda: False)
    graphs = []
    compile_call = compile_backend.SglPiecewiseBackend.__call__

    def keep_graph(self, gm, example_inputs):
        graphs.append([(n.op, n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return compile_call(self, gm, example_inputs)

    monkeypatch.setattr(compile_backend.SglPiecewiseBackend, "__call__", keep_graph)
    model, backend = model_and_backend()
    compiled = CompiledModel(model, CompileOptions(piece_compiler="eager", cudagraphs=True, **options))
    out, want = step(compiled, model, backend, [3, 2])
    monkeypatch.undo()
    (graph,) = graphs
    if not options.get("dynamo_guards", False):
        # No guard of the trace (the regions' switch included) keeps a later
        # call of another token count on Dynamo.
        monkeypatch.setattr(compiled, "compiled", None)  # Dynamo's entry: calling it would raise
        torch.testing.assert_close(*step(compiled, model, backend, [4, 1]), atol=1e-5, rtol=1e-5)
        monkeypatch.undo()
    return graph, out, want, compiled.token_guards.constants


@needs_reuse
def test_each_region_is_traced_once_and_the_backend_gets_the_flat_graph(monkeypatch):
    from torch._dynamo.variables import invoke_subgraph

    stamped = []
    stamp_out = invoke_subgraph.stamp_out_subgraph

    def count(*args, **kwargs):
        stamped.append(1)
        return stamp_out(*args, **kwargs)

    monkeypatch.setattr(invoke_subgraph, "stamp_out_subgraph", count)
    with_regions, out, want, _ = traced_graph(monkeypatch, with_regions=True)
    # Two regions a layer, each traced at layer 0 and stamped out for the rest.
    assert len(stamped) == 2 * (LAYERS - 1)
    assert not any(target is torch.ops.higher_order.invoke_subgraph for _, target in with_regions)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    plain, *_ = traced_graph(monkeypatch, with_regions=False)
    assert with_regions == plain  # the same ops in the same order


def test_without_reuse_a_trace_calls_the_functions_as_written(monkeypatch):
    graph, out, want, _ = traced_graph(monkeypatch, with_regions=False)
    attention = torch.ops.sgl_piecewise.unified_attention
    assert sum(target in (attention, attention.default) for _, target in graph) == LAYERS
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@needs_reuse
def test_calls_through_dynamo_trace_every_layer_so_every_layers_constants_are_guarded(monkeypatch):
    """Dynamo checks a stamped-out region's constants (a later layer's
    ``eps``) when it traces, but guards only the first layer's: with
    ``dynamo_guards`` every call goes through those guards, so its trace
    has no regions."""
    from torch._dynamo.variables import invoke_subgraph

    stamped = []
    stamp_out = invoke_subgraph.stamp_out_subgraph
    monkeypatch.setattr(invoke_subgraph, "stamp_out_subgraph", lambda *a, **k: stamped.append(1) or stamp_out(*a, **k))
    *_, constants = traced_graph(monkeypatch, with_regions=True, dynamo_guards=True)
    assert stamped == []
    guarded = {source for source, _ in constants}
    for layer in range(LAYERS):
        assert any(f"['{layer}']" in s and "post_attention_layernorm" in s and s.endswith(".eps") for s in guarded)


def test_tracing_regions_switches_the_marked_functions_only_inside(monkeypatch):
    calls = []

    @regions.repeated_region
    def add_one(x):
        calls.append(regions._tracing_regions())
        return x + 1

    x = torch.arange(3.0)
    assert torch.equal(add_one(x), x + 1)  # eager: the function itself
    with regions.tracing_regions() as on:
        assert on == regions.regions_available()
        assert torch.equal(add_one(x), x + 1)  # eager inside too: the region wrapper runs it as is
    assert calls == [False, on] and regions._tracing_regions() is False
    monkeypatch.setattr(regions, "regions_available", lambda: False)
    with regions.tracing_regions() as on:
        assert on is False and regions._tracing_regions() is False


@needs_reuse
def test_the_switch_is_per_thread():
    """A trace on another thread (a model that keeps Dynamo's guards) is not switched."""
    seen = []
    with regions.tracing_regions() as on:
        other = threading.Thread(target=lambda: seen.append(regions._tracing_regions()))
        other.start()
        other.join()
        assert on and regions._tracing_regions()
    assert seen == [False]


def test_marking_what_is_not_a_function_is_refused_by_name():
    with pytest.raises(InvalidTypeError, match="repeated_region: expected a function or method, got 3"):
        regions.repeated_region(3)
