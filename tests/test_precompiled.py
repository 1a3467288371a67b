"""Piecewise graphs called without Dynamo. After its first compile a
``CompiledModel`` calls its module directly; with ``cache_dir`` the compile is
saved whole, and a later process calls it without Dynamo and gets the first
process's outputs; anything it depends on keys it, so a changed model traces
afresh; a model whose call is more than its graph stays on Dynamo and saves
nothing."""

import dataclasses
import logging
import textwrap

import pytest
import torch

from sgl_piecewise.compile import CompiledModel, CompileOptions, counters, precompiled
from sgl_piecewise.compile.direct_call import GraphInput, make_gather
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.graphs import weight_guard
from sgl_piecewise.models import build_random_model, default_config

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

PROCESS = textwrap.dedent(
    """
    import dataclasses, json, sys
    import torch
    from torch._dynamo.utils import counters as dynamo_counters
    from sgl_piecewise.compile import CompileOptions, counters
    from sgl_piecewise.models import build_random_model, default_config
    from sgl_piecewise.engine.runner import ModelRunner
    from sgl_piecewise.runners import PiecewiseCudaGraphRunner

    cache_dir, layers, device = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    config = dataclasses.replace(default_config(), num_hidden_layers=layers)
    model = build_random_model(config, torch.float32, device, seed=0)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    eager = ModelRunner(model, max_reqs=3, max_context_len=64, backend="torch").generate(prompts, 6)
    counters.step_paths.clear()
    runner = ModelRunner(model, max_reqs=3, max_context_len=64, backend="torch")
    graphs = PiecewiseCudaGraphRunner(runner, CompileOptions(cudagraphs=True, capture_sizes=(1, 2, 4, 8, 16),
                                                             cache_dir=cache_dir))
    runner.use_graphs(graphs, progress=False)
    tokens = runner.generate(prompts, 6)
    print(json.dumps({"loaded": counters.compiles_loaded, "saved": counters.compiles_saved,
                      "traced": dynamo_counters["stats"]["unique_graphs"], "split": counters.graphs_split,
                      "tokens": tokens, "eager": eager, "paths": sorted({p for p, _ in counters.step_paths})}))
    """
)


@pytest.fixture
def start_a_process(fresh_process):
    """The process started; its ``result()`` waits for what it printed."""

    def start(cache_dir, inductor_dir, layers: int, device: str = "cpu"):
        return fresh_process.start(PROCESS, cache_dir, layers, device, inductor_dir=inductor_dir)

    return start


def test_a_second_process_runs_the_saved_compile_without_dynamo_and_a_changed_model_traces_afresh(
    tmp_path, start_a_process
):
    cache = tmp_path / "compiles"
    # Each process has an empty Inductor cache of its own: only the saved
    # compile can carry the pieces from one process to the next.
    first = start_a_process(cache, tmp_path / "inductor1", layers=2).result()
    assert (first["loaded"], first["saved"], first["traced"], first["split"]) == (0, 1, 1, 1)
    assert first["tokens"] == first["eager"]
    assert first["paths"] == ["piecewise"]
    # Both start from the first's entry, and each reads only its own model's
    # (entries are keyed and written whole): they run side by side.
    second = start_a_process(cache, tmp_path / "inductor2", layers=2)
    changed = start_a_process(cache, tmp_path / "inductor3", layers=3)
    second, changed = second.result(), changed.result()
    assert (second["loaded"], second["saved"], second["traced"], second["split"]) == (1, 0, 0, 0)
    assert second["tokens"] == first["tokens"]
    assert second["paths"] == ["piecewise"]
    assert (changed["loaded"], changed["saved"], changed["traced"]) == (0, 1, 1)
    assert changed["tokens"] == changed["eager"]
    assert len(list(cache.glob("graph-*/entry.pkl"))) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_second_process_on_cuda_replays_the_first_process_compile(tmp_path, start_a_process):
    cache = tmp_path / "compiles"
    first = start_a_process(cache, tmp_path / "inductor1", layers=2, device="cuda").result()
    second = start_a_process(cache, tmp_path / "inductor2", layers=2, device="cuda").result()
    assert (first["saved"], second["loaded"], second["traced"]) == (1, 1, 0)
    assert second["tokens"] == first["tokens"] == first["eager"]


# ---- the key ---------------------------------------------------------------
GRAPHS = CompileOptions(cudagraphs=True)


def _key(model, options=GRAPHS, dtype=torch.int64):
    args = (torch.zeros(3, dtype=dtype), torch.zeros(3, dtype=torch.int64))
    return precompiled.model_key(model, args, options)


def test_the_key_changes_with_anything_the_compile_depends_on(monkeypatch):
    config = dataclasses.replace(default_config(), num_hidden_layers=2)
    model = build_random_model(config)
    key = _key(model)
    assert _key(build_random_model(config, seed=1)) == key  # other weights, same compile
    assert _key(build_random_model(dataclasses.replace(config, rms_norm_eps=1e-4))) != key  # a constant of the trace
    assert _key(build_random_model(dataclasses.replace(config, num_hidden_layers=3))) != key
    assert _key(build_random_model(config, dtype=torch.float64)) != key
    assert _key(model, CompileOptions(cudagraphs=True, capture_sizes=(1, 2))) != key
    assert _key(model, dtype=torch.int32) != key
    down = model.model.layers[0].mlp.down_proj
    down.weight = torch.nn.Parameter(down.weight.t().contiguous().t())
    assert _key(model) != key  # another stride
    with torch.no_grad():
        assert _key(build_random_model(config)) != key
    fresh = build_random_model(config)
    hook = fresh.model.norm.register_forward_hook(lambda module, args, out: out * 2)
    assert _key(fresh) != key  # a hook the trace would run
    hook.remove()
    assert _key(fresh) == key
    hook = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    assert _key(fresh) != key
    hook.remove()
    # The library's own watch of assignments runs in no forward: a process
    # that installed it before computing the key must find the same key as
    # one that did after (installed once per process; a table of its own here).
    torch_hooks = torch.nn.modules.module
    table = "_global_parameter_registration_hooks"
    monkeypatch.setattr(torch_hooks, table, {**getattr(torch_hooks, table), -1: weight_guard._on_assignment})
    assert _key(fresh) == key
    monkeypatch.setattr(torch_hooks, table, {**getattr(torch_hooks, table), -2: lambda module, name, value: None})
    assert _key(fresh) != key  # anyone else's hook still counts
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert _key(build_random_model(config)) != key


# ---- toy models: what is saved, and what is not ---------------------------------
class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("offset", torch.linspace(0, 1, 8))

    def forward(self, ids, positions):
        return self.proj(self.embed(ids)) + self.offset + positions[:, None]


def _options(tmp_path=None, **extra):
    cache_dir = None if tmp_path is None else str(tmp_path)
    return CompileOptions(cudagraphs=True, capture_sizes=(2, 4), piece_compiler="eager", cache_dir=cache_dir, **extra)


def _call(compiled, n):
    ids, positions = torch.arange(n) % 50, torch.arange(n, dtype=torch.float32)
    return compiled(ids, positions), (ids, positions)


@torch.no_grad()
def test_a_new_compiled_model_of_the_same_model_starts_from_the_saved_compile(tmp_path):
    model = Toy()
    for n in (3, 1, 4):
        _call(CompiledModel(model, _options(tmp_path)), n)
    assert (counters.compiles_saved, counters.compiles_loaded, counters.graphs_split) == (1, 2, 1)
    warm = CompiledModel(model, _options(tmp_path))
    for n in (3, 1, 2, 6):  # 6: above the capture sizes, run without graphs
        out, args = _call(warm, n)
        torch.testing.assert_close(out, model(*args))
    assert counters.graphs_split == 1  # no trace since the first
    (module,) = warm.piecewise_modules  # the loaded one, for tools that inspect it
    assert not warm.backend.modules and module.captured


@torch.no_grad()
def test_weights_of_another_layout_leave_the_saved_compile_for_a_trace(tmp_path):
    model = Toy()
    _call(CompiledModel(model, _options(tmp_path)), 3)
    warm = CompiledModel(model, _options(tmp_path))
    _call(warm, 3)
    assert counters.compiles_loaded == 1
    model.proj.weight = torch.nn.Parameter(model.proj.weight.t().contiguous().t())  # same values, other strides
    out, args = _call(warm, 3)
    torch.testing.assert_close(out, model(*args))
    assert counters.graphs_split == 2  # traced again


def test_a_call_with_grad_enabled_goes_through_dynamo(tmp_path):
    model = Toy()
    with torch.no_grad():
        _call(CompiledModel(model, _options(tmp_path)), 3)
        warm = CompiledModel(model, _options(tmp_path))
        _call(warm, 3)
    out, args = _call(warm, 3)
    torch.testing.assert_close(out, model(*args))
    assert counters.graphs_split == 2


SCALE = torch.full((8,), 2.0)


class ReadsAGlobal(Toy):
    def forward(self, ids, positions):
        return super().forward(ids, positions) * SCALE


class SetsAnAttribute(Toy):
    def forward(self, ids, positions):
        self.calls = getattr(self, "calls", 0) + 1
        return super().forward(ids, positions)


ALPHA = 2.0


class ReadsAGlobalNumber(Toy):
    def forward(self, ids, positions):
        return super().forward(ids, positions) * ALPHA


class BranchesOnTokenCount(Toy):
    def forward(self, ids, positions):
        out = super().forward(ids, positions)
        return out * 2 if ids.shape[0] > 2 else out


class ReturnsADict(Toy):
    def forward(self, ids, positions):
        return {"hidden": super().forward(ids, positions)}


# Calls that are more than their graph, and the reason each one logs.
MORE_THAN_ITS_GRAPH = [
    (ReadsAGlobal, "is no argument, token count, parameter or buffer"),
    (SetsAnAttribute, "side effects"),
    (ReturnsADict, "returns more than the graph's outputs"),
    (BranchesOnTokenCount, "holds only for some token counts"),
    (ReadsAGlobalNumber, "cannot be checked without Dynamo"),
]


@pytest.mark.parametrize("model_cls, reason", MORE_THAN_ITS_GRAPH)
@torch.no_grad()
def test_a_call_that_is_more_than_its_graph_saves_nothing_and_says_why(tmp_path, caplog, model_cls, reason):
    model = model_cls()
    with caplog.at_level(logging.INFO, logger="sgl_piecewise.compile"):
        _call(CompiledModel(model, _options(tmp_path)), 3)
    assert reason in caplog.text
    assert counters.compiles_saved == 0 and not list(tmp_path.glob("graph-*/entry.pkl"))
    again = CompiledModel(model, _options(tmp_path))
    for n in (3, 1):  # traces again, and is right on both sides of any branch
        out, args = _call(again, n)
        expected = model(*args)
        torch.testing.assert_close(out["hidden"] if isinstance(out, dict) else out,
                                   expected["hidden"] if isinstance(expected, dict) else expected)  # fmt: skip
    assert counters.compiles_loaded == 0


@torch.no_grad()
def test_a_changed_source_file_or_a_damaged_entry_traces_afresh(tmp_path, caplog):
    model = Toy()
    _call(CompiledModel(model, _options(tmp_path)), 3)
    (entry,) = tmp_path.glob("graph-*/entry.pkl")
    key = entry.parent.name.removeprefix("graph-")
    saved = precompiled.load_entry(str(tmp_path), key)
    assert __file__ in saved.sources  # Toy.forward was traced from this file
    saved.sources[__file__] = "0" * 64  # as if this file had changed since
    precompiled.save(str(tmp_path), key, saved, [])
    with caplog.at_level(logging.INFO, logger="sgl_piecewise.compile"):
        assert precompiled.load_entry(str(tmp_path), key) is None
    assert "changed since" in caplog.text
    entry.write_bytes(b"not a pickle")
    assert precompiled.load_entry(str(tmp_path), key) is None
    out, args = _call(CompiledModel(model, _options(tmp_path)), 3)
    torch.testing.assert_close(out, model(*args))
    assert counters.graphs_split == 2 and counters.compiles_saved == 2  # traced and saved anew


def test_gather_fetches_arguments_token_counts_parameters_and_buffers():
    model = Toy()
    gather = make_gather([GraphInput("param", "proj.weight"), GraphInput("tokens", 1), GraphInput("arg", 0),
                          GraphInput("buffer", "offset"), GraphInput("param", "embed.weight")])  # fmt: skip
    ids, positions = torch.zeros(5, dtype=torch.int64), torch.zeros(5)
    got = gather(model, (ids, positions))
    assert got[0] is model.proj.weight and got[1] == 5 and got[2] is ids
    assert got[3] is model.offset and got[4] is model.embed.weight


@torch.no_grad()
def test_a_cache_dir_that_cannot_be_written_costs_the_save_not_the_step(tmp_path, caplog):
    model = Toy()
    not_a_dir = tmp_path / "a file"
    not_a_dir.write_text("")
    with caplog.at_level(logging.WARNING, logger="sgl_piecewise.compile"):
        out, args = _call(CompiledModel(model, _options(not_a_dir)), 3)
    torch.testing.assert_close(out, model(*args))
    assert "compile not saved" in caplog.text and counters.compiles_saved == 0


class Scale:
    """A plain object (no module, no dataclass): the key does not see it."""

    def __init__(self, value):
        self.value = value


class ReadsAnObjectAttribute(Toy):
    def __init__(self):
        super().__init__()
        self.scale = Scale(2.0)

    def forward(self, ids, positions):
        return super().forward(ids, positions) * self.scale.value


@torch.no_grad()
def test_a_constant_the_trace_read_that_changed_makes_the_saved_compile_stale(tmp_path, caplog):
    model = ReadsAnObjectAttribute()
    _call(CompiledModel(model, _options(tmp_path)), 3)
    assert counters.compiles_saved == 1
    model.scale.value = 3.0  # same key: only Dynamo's guard on it knows
    with caplog.at_level(logging.INFO, logger="sgl_piecewise.compile"):
        out, args = _call(CompiledModel(model, _options(tmp_path)), 3)
    torch.testing.assert_close(out, model(*args))
    assert counters.compiles_loaded == 0
    assert "scale.value is 3.0, traced as 2.0" in caplog.text


# ---- the compiling process: later calls without Dynamo ----------------------------
def _count_dynamo_calls(compiled: CompiledModel) -> list:
    """Record every call that reaches Dynamo's compiled function."""
    calls, through_dynamo = [], compiled.compiled
    compiled.compiled = lambda *args: calls.append(args[0].shape[0]) or through_dynamo(*args)
    return calls


@torch.no_grad()
def test_after_the_first_compile_calls_skip_dynamo_and_equal_eager():
    model = Toy()
    compiled = CompiledModel(model, _options())
    calls = _count_dynamo_calls(compiled)
    for n in (3, 1, 4, 6):  # 6: above the capture sizes, run without graphs
        out, args = _call(compiled, n)
        torch.testing.assert_close(out, model(*args))
    assert calls == [3] and counters.graphs_split == 1


@torch.no_grad()
def test_dynamo_guards_keeps_every_call_on_dynamo_so_a_changed_constant_recompiles():
    model = ReadsAnObjectAttribute()
    compiled = CompiledModel(model, _options(dynamo_guards=True))
    calls = _count_dynamo_calls(compiled)
    _call(compiled, 3)
    model.scale.value = 3.0
    out, args = _call(compiled, 3)
    torch.testing.assert_close(out, model(*args))
    assert calls == [3, 3] and counters.graphs_split == 2


@torch.no_grad()
def test_weights_of_another_layout_trace_afresh_then_skip_dynamo_again():
    model = Toy()
    compiled = CompiledModel(model, _options())
    calls = _count_dynamo_calls(compiled)
    _call(compiled, 3)
    model.proj.weight = torch.nn.Parameter(model.proj.weight.t().contiguous().t())  # same values, other strides
    for n in (3, 2):
        out, args = _call(compiled, n)
        torch.testing.assert_close(out, model(*args))
    assert calls == [3, 3] and counters.graphs_split == 2


def test_a_call_with_grad_enabled_goes_through_dynamo_and_no_grad_calls_still_skip_it():
    model = Toy()
    compiled = CompiledModel(model, _options())
    calls = _count_dynamo_calls(compiled)
    with torch.no_grad():
        _call(compiled, 3)
    out, args = _call(compiled, 3)
    torch.testing.assert_close(out, model(*args))
    with torch.no_grad():
        _call(compiled, 2)
    assert calls == [3, 3]


@pytest.mark.parametrize("model_cls, reason", MORE_THAN_ITS_GRAPH)
@torch.no_grad()
def test_a_call_that_is_more_than_its_graph_stays_on_dynamo_and_says_why(caplog, model_cls, reason):
    model = model_cls()
    compiled = CompiledModel(model, _options())
    calls = _count_dynamo_calls(compiled)
    with caplog.at_level(logging.INFO, logger="sgl_piecewise.compile"):
        for n in (3, 3):
            _call(compiled, n)
    assert "graph not callable without Dynamo: " in caplog.text and reason in caplog.text
    assert calls == [3, 3]


@torch.no_grad()
def test_token_inputs_are_padded_with_zeros_and_other_dtypes_widened_or_refused():
    """Inputs laid out as traced take the registry's planned fill, their
    padded rows zeroed; others its checked fill (a call through Dynamo never
    hands over other dtypes, a caller of the module itself may)."""
    model = Toy()
    compiled = CompiledModel(model, _options())
    _call(compiled, 3)
    (module,) = compiled.piecewise_modules
    ids_at, positions_at = module.token_axis.tensor_inputs  # Toy's two token inputs
    args = [None] * (max(ids_at, positions_at) + 1)
    args[ids_at], args[positions_at] = torch.tensor([7, 8, 9, 10]), torch.full((4,), 2.0)
    module._pad(args, 4, 4)  # every row real: the padded row below held 10 and 2.0
    args[ids_at], args[positions_at] = torch.tensor([4, 5, 6]), torch.ones(3)
    padded = module._pad(args, 3, 4)
    assert padded[ids_at].tolist() == [4, 5, 6, 0] and padded[positions_at].tolist() == [1, 1, 1, 0]
    args[ids_at] = torch.tensor([4, 5, 6], dtype=torch.int32)
    padded = module._pad(args, 3, 4)
    assert padded[ids_at].dtype == torch.int64 and padded[ids_at].tolist() == [4, 5, 6, 0]
    assert padded[positions_at].tolist() == [1, 1, 1, 0]
    args[ids_at] = args[ids_at].float()
    with pytest.raises(InvalidInputError, match="casts safely"):
        module._pad(args, 3, 4)
