"""``CompiledModel``'s backed token axis: Dynamo's shape guards are dropped
only when they merely bound the token count from below (``token_guards.py``);
a guard that selects what the graph computes keeps every shape guard, so
that step recompiles and stays equal to eager."""

import pytest
import sympy
import torch

import sgl_piecewise as sp
from sgl_piecewise.backends import ReferenceBackend
from sgl_piecewise.compile import CompiledModel, CompileOptions, compiled_model, counters, token_guards
from sgl_piecewise.compile.token_guards import MAX_TRACED_TOKENS, _only_bounds_token_count
from sgl_piecewise.engine.testing import random_batch, two_layer_llama_config
from sgl_piecewise.models import build_random_model

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

S0, S1, OTHER = sympy.symbols("s0 s1 s9", integer=True, positive=True)
TOKENS = {S0, S1}


@pytest.mark.parametrize(
    "expr",
    [
        S0 >= 2,
        S0 > 1,
        sympy.Le(2, S0),
        sympy.Lt(1, S0),
        S0 >= 0,
        3 * S0 >= 6,
        sympy.Ne(S0, 1),
        sympy.Ne(0, S0),
        sympy.Eq(S0, S1),
        896 * S0 <= 2**31 - 1,  # int32 indexing, far above the traced bound
        S0 <= MAX_TRACED_TOKENS,
        sympy.Lt(S0, MAX_TRACED_TOKENS + 1),
    ],
)
def test_lower_bounds_of_at_most_two_and_token_equalities_are_droppable(expr):
    assert _only_bounds_token_count(expr, TOKENS)


@pytest.mark.parametrize(
    "expr",
    [
        S0 > 4,  # a Python branch on the token count
        S0 >= 3,
        2 * S0 - 1 >= 7,
        S0 <= 512,  # an upper bound below the traced one: larger counts would run code traced for smaller ones
        sympy.Lt(S0, 9),
        S0 < MAX_TRACED_TOKENS,
        S0**2 <= 2**31 - 1,
        sympy.Eq(S0, 1),  # a specialisation to one size
        sympy.Ne(S0, 3),
        sympy.Eq(S0, OTHER),  # another dynamic size
        OTHER >= 2,
        sympy.Eq(sympy.Mod(S0, 8), 0),
        sympy.Eq(2 * S0, S1),
    ],
)
def test_any_other_shape_guard_is_kept(expr):
    assert not _only_bounds_token_count(expr, TOKENS)


def _small_model():
    return build_random_model(two_layer_llama_config(), seed=1)


class BranchesOnTokenCount(torch.nn.Module):
    """A model whose Python takes another path above 4 tokens: Dynamo guards
    the trace on that comparison."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, positions):
        hidden = self.inner(input_ids, positions)
        if input_ids.shape[0] > 4:
            return hidden * 2
        return hidden


def _step(fn, backend, n):
    batch = random_batch(sp.ForwardMode.EXTEND, backend.req_to_token_pool, backend.kv_pool, [0], [n], vocab_size=256)
    backend.init_forward_metadata(batch)
    with torch.no_grad(), sp.forward_context(batch, backend):
        return batch, fn(batch.input_ids, batch.positions)


def _small_backend():
    return ReferenceBackend(sp.ReqToTokenPool(max_reqs=8, max_context_len=64), sp.KVPool(512, 2, 2, 16))


def _step_equals_eager(compiled, model, backend, n):
    """One EXTEND step of ``n`` tokens through ``compiled`` equals ``model`` eagerly."""
    batch, got = _step(compiled, backend, n)
    with torch.no_grad(), sp.forward_context(batch, backend):
        want = model(batch.input_ids, batch.positions)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_branch_on_the_token_count_keeps_the_guards_and_recompiles_instead_of_running_the_wrong_side():
    model = BranchesOnTokenCount(_small_model())
    backend = _small_backend()
    compiled = CompiledModel(model, CompileOptions(piece_compiler="eager"))
    for n in (7, 3, 1, 9):  # both sides of the branch, and 1 token
        _step_equals_eager(compiled, model, backend, n)
    assert compiled.token_guards.dropped == 0
    assert "selects what the graph computes" in compiled.token_guards.kept_reason


def test_a_first_call_of_one_token_traces_for_every_count():
    """Backed, Inductor would read the hint 1 and guard ``Eq(s0, 1)``,
    keeping the trace to one token; a first call below 2 tokens marks the
    axis unbacked, so 2 and 5 tokens run the first trace."""
    model = _small_model()
    backend = _small_backend()
    compiled = CompiledModel(model, CompileOptions(piece_compiler="inductor"))
    for i, n in enumerate((1, 2, 5)):
        if i == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            _step_equals_eager(compiled, model, backend, n)
        finally:
            torch.compiler.set_stance("default")
    assert compiled.token_guards.kept_reason is None


def test_a_call_above_the_traced_bound_runs_uncompiled_and_is_counted(monkeypatch):
    """The graph is traced for at most MAX_TRACED_TOKENS tokens and its shape
    guards are gone, so a larger call must not reach it (here the bound is 8)."""
    monkeypatch.setattr(token_guards, "MAX_TRACED_TOKENS", 8)
    monkeypatch.setattr(compiled_model, "MAX_TRACED_TOKENS", 8)
    model = _small_model()
    backend = _small_backend()
    compiled = CompiledModel(model, CompileOptions(piece_compiler="eager"))
    for n in (5, 12):
        _step_equals_eager(compiled, model, backend, n)
    assert dict(counters.eager_fallbacks) == {"12 tokens: above the compiled graph's 8": 1}
    assert counters.graphs_split == 1 and compiled.token_guards.dropped == 1


def test_a_trace_that_was_not_size_oblivious_keeps_the_guards(monkeypatch):
    """Without size-oblivious tracing the trace may have specialised on the
    token count being at least 2, so its lower bound must stay: the 1-token
    call recompiles (and equals eager) instead of running that trace."""
    monkeypatch.setattr(token_guards.size_oblivious_tracing, "__enter__", lambda self: None)
    monkeypatch.setattr(token_guards.size_oblivious_tracing, "__exit__", lambda self, *exc: None)
    model = _small_model()
    backend = _small_backend()
    compiled = CompiledModel(model, CompileOptions(piece_compiler="eager"))
    for n in (5, 1):
        _step_equals_eager(compiled, model, backend, n)
        if n == 5:
            assert "without size-oblivious tracing" in compiled.token_guards.kept_reason
    assert compiled.token_guards.dropped == 0 and counters.graphs_split == 2  # 1 token recompiled
