"""Compile artifacts saved for later processes (``CompileOptions(cache_dir=...)``):
a second process starts from them, and anything a compiled artifact depends
on keys them, so a changed model compiles afresh."""

import textwrap

import torch

from sgl_piecewise.compile.artifacts import artifact_key
from sgl_piecewise.compile.options import CompileOptions

PROCESS = textwrap.dedent(
    """
    import dataclasses, json, sys
    from torch._dynamo.utils import counters as dynamo_counters
    from sgl_piecewise.compile import CompiledModel, CompileOptions, counters
    from sgl_piecewise.models import build_random_model, default_config
    from sgl_piecewise.engine.runner import ModelRunner

    config = dataclasses.replace(default_config(), num_hidden_layers=int(sys.argv[2]))
    model = build_random_model(config)
    runner = ModelRunner(model, max_reqs=2, max_context_len=64)
    runner.model_forward = CompiledModel(model, CompileOptions(cache_dir=sys.argv[1]))
    runner.generate([[1, 2, 3]], 2)
    inductor = dynamo_counters["inductor"]
    print(json.dumps({"loaded": counters.artifacts_loaded, "saved": counters.artifacts_saved,
                      "hits": inductor["fxgraph_cache_hit"], "misses": inductor["fxgraph_cache_miss"]}))
    """
)


def test_a_second_process_starts_from_the_saved_artifacts_and_a_changed_model_compiles_afresh(tmp_path, fresh_process):
    def compile_in_a_fresh_process(cache_dir, inductor_dir, layers: int):
        return fresh_process.start(PROCESS, cache_dir, layers, inductor_dir=inductor_dir, timeout=600)

    cache = tmp_path / "artifacts"
    # Each process has an empty Inductor cache of its own: only the artifact
    # files can carry a compile from one process to the next. A 2-layer model
    # splits into 3 distinct pieces (first, middle, last).
    first = compile_in_a_fresh_process(cache, tmp_path / "inductor1", layers=2).result()
    assert first == {"loaded": 0, "saved": 1, "hits": 0, "misses": 3}
    # Both start from the first's file, and each reads only its own model's
    # (files are keyed and written whole): they run side by side.
    second = compile_in_a_fresh_process(cache, tmp_path / "inductor2", layers=2)
    changed = compile_in_a_fresh_process(cache, tmp_path / "inductor3", layers=3)
    assert second.result() == {"loaded": 1, "saved": 0, "hits": 3, "misses": 0}
    assert changed.result() == {"loaded": 0, "saved": 1, "hits": 0, "misses": 3}
    assert len(list(cache.glob("*.bin"))) == 2


def test_the_key_changes_with_options_versions_and_device(monkeypatch):
    options, cpu = CompileOptions(), torch.device("cpu")
    key = artifact_key("graph", options, cpu)
    assert artifact_key("graph", options, cpu) == key
    assert artifact_key("another graph", options, cpu) != key  # model shape or dtype: the graph's input signature
    assert artifact_key("graph", CompileOptions(piece_compiler="eager"), cpu) != key
    assert artifact_key("graph", options, torch.device("meta")) != key
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert artifact_key("graph", options, cpu) != key


def test_the_graph_key_changes_with_the_inputs_dtype_and_shape():
    from sgl_piecewise.compile.artifacts import graph_key

    gm = torch.fx.symbolic_trace(lambda x, w: x @ w)
    x, w = torch.ones(2, 4), torch.ones(4, 3)
    key = graph_key(gm, [x, w])
    assert graph_key(gm, [x, w.clone()]) == key
    assert graph_key(gm, [x.bfloat16(), w.bfloat16()]) != key
    assert graph_key(gm, [x, torch.ones(4, 5)]) != key
