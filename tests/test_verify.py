"""``verify``: graph replay against eager on random ragged batches, and the
``sgl-piecewise verify`` command. It must pass on a correct stack, check
every path its policies offer, run each step on the prefixes an eager
prefill writes (alike in every runner), and fail on a broken one."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from test_whole_model_runner import CONFIG

from sgl_piecewise.backends import create_backend
from sgl_piecewise.engine import testing
from sgl_piecewise.engine import verify as verify_module
from sgl_piecewise.engine.cli import main
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.engine.verify import verify
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.forward import ForwardBatch, ForwardMode
from sgl_piecewise.memory import KVPool, ReqToTokenPool, allocate_requests
from sgl_piecewise.models import build_random_model
from sgl_piecewise.runners.breakable import BreakableCudaGraphRunner
from sgl_piecewise.runners.eager import run_model
from sgl_piecewise.runners.whole_model import CudaGraphRunner

# Each compile here adds a Dynamo cache entry for the same model code; entries
# left by other tests must not push it past the recompile limit.
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


BACKEND = partial(create_backend, "torch", num_q_heads=CONFIG.num_attention_heads)


def _model(dtype=torch.float32):
    return build_random_model(CONFIG, dtype, seed=2, std=0.2)


def _verify(dtype=torch.float32, **kw):
    kw = {"max_bs": 4, "max_context_len": 96, "progress": False, "piece_compiler": "eager", **kw}
    return verify(_model(dtype), BACKEND, **kw)


def test_a_correct_stack_passes_on_every_path_its_policies_offer():
    reports = _verify(steps=30, seed=1)
    assert all(r.ok for r in reports.values()), reports
    # Every step runs through both graph runners (auto and breakable).
    assert sum(r.steps for r in reports.values()) == 2 * 30
    offered = {("EXTEND", "piecewise"), ("MIXED", "piecewise"), ("DECODE", "whole_model"),
               ("EXTEND", "breakable"), ("MIXED", "breakable"), ("DECODE", "breakable")}  # fmt: skip
    assert offered <= set(reports)
    # Decode batches of 5 requests (above the largest whole-model graph, 4) run pieces under auto.
    assert reports[("DECODE", "piecewise")].sizes == [5] * reports[("DECODE", "piecewise")].steps


@pytest.mark.parametrize("runner, broken", [(CudaGraphRunner, {("DECODE", "whole_model")}),
                                            (BreakableCudaGraphRunner, None)])  # fmt: skip
def test_a_graph_runner_that_returns_wrong_hidden_states_fails_on_its_paths_only(monkeypatch, runner, broken):
    method = "try_replay" if runner is CudaGraphRunner else "replay"
    real = getattr(runner, method)

    def off_by_a_bit(self, *args):
        hidden = real(self, *args)
        return None if hidden is None else hidden + 1e-2

    monkeypatch.setattr(runner, method, off_by_a_bit)
    reports = _verify(steps=12, seed=3)
    failed = {key for key, r in reports.items() if not r.ok}
    if broken is None:  # every path the breakable runner took
        broken = {key for key in reports if key[1] == "breakable"}
    assert broken and failed == broken


def _prefix_kv(req_pool: ReqToTokenPool, kv_pool: KVPool, rows, prefix_lens):
    """Per request with a prefix, K and V of every layer at its prefix slots."""
    out = []
    for row, p in zip(rows, prefix_lens):
        if p:
            slots = req_pool.req_to_token[row, :p].to(torch.int64)
            out.append([(k[slots].clone(), v[slots].clone()) for k, v in zip(kv_pool.k_buffers, kv_pool.v_buffers)])
    return out


def _direct_prefill(model, prefix_lens, seed):
    """Prefix K/V of one plain eager EXTEND over the prefix tokens a step of
    ``seed`` draws (its generator's first draw), in pools of its own."""
    prompts = [p for p in prefix_lens if p]
    ids = torch.randint(0, CONFIG.vocab_size, (sum(prompts),), generator=torch.Generator().manual_seed(seed))
    req_pool = ReqToTokenPool(len(prompts), max(prompts))
    kv_pool = KVPool(sum(prompts), CONFIG.num_hidden_layers, CONFIG.num_key_value_heads, CONFIG.head_dim)
    rows, loc = allocate_requests(req_pool, kv_pool, [0] * len(prompts), prompts)
    batch = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, [0] * len(prompts), prompts, loc)
    with torch.no_grad():
        run_model(model, batch, BACKEND(req_pool, kv_pool))
    return _prefix_kv(req_pool, kv_pool, rows.tolist(), prompts)


def test_a_step_runs_on_the_prefixes_an_eager_prefill_writes_bit_identical_in_every_runner(monkeypatch):
    model = _model()
    eager = ModelRunner(model, max_reqs=4, max_context_len=32, backend=BACKEND)
    graphed = ModelRunner(model, max_reqs=4, max_context_len=32, backend=BACKEND, graphs="full")
    graphed.capture_graphs(progress=False, capture_bs=[4])
    seen = []
    real = ModelRunner.forward_step

    def snapshot_prefixes(self, batch, **kw):  # what the step reads, before it writes its new tokens
        rows, prefix = batch.req_pool_indices_cpu.tolist(), batch.extend_prefix_lens_cpu
        seen.append(_prefix_kv(self.req_to_token_pool, self.kv_pool, rows, prefix))
        return real(self, batch, **kw)

    monkeypatch.setattr(ModelRunner, "forward_step", snapshot_prefixes)
    prefix, seed = [5, 0, 12], 7
    logits = [verify_module._step(r, ForwardMode.DECODE, prefix, [1, 1, 1], seed) for r in (eager, graphed)]
    assert [r.step_stats[-1].path for r in (eager, graphed)] == ["eager", "whole_model"]
    want = _direct_prefill(model, prefix, seed)
    assert len(seen) == 2
    for got in seen:
        assert len(got) == len(want) == 2
        for request, direct in zip(got, want):
            for (k, v), (k0, v0) in zip(request, direct):
                assert torch.equal(k, k0) and torch.equal(v, v0)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-3, rtol=1e-3)
    for r in (eager, graphed):  # prefix and new slots, and the rows, all given back
        assert r.kv_pool.available == r.kv_pool.num_slots and r.req_to_token_pool.available == 4


def test_a_prefill_that_fails_gives_back_every_row_and_slot(monkeypatch):
    runner = ModelRunner(_model(), max_reqs=4, max_context_len=32, backend=BACKEND)

    def broken(*args):
        raise RuntimeError("prefill failed")

    monkeypatch.setattr(testing, "run_model", broken)
    with pytest.raises(RuntimeError, match="prefill failed"):
        verify_module._step(runner, ForwardMode.MIXED, [3, 0, 9], [2, 1, 4], seed=0)
    assert runner.kv_pool.available == runner.kv_pool.num_slots and runner.req_to_token_pool.available == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_graph_that_reads_one_cached_token_from_a_wrong_slot_fails(monkeypatch, dtype):
    """Prefixes the model wrote are smoother than noise; a graph that reads
    a request's second cached token in place of its first (a page table off
    by one) must still show."""
    real = CudaGraphRunner.replay

    def first_cached_token_from_the_second_slot(self, batch, padded_bs):
        table = self.model_runner.req_to_token_pool.req_to_token
        rows = batch.req_pool_indices_cpu[torch.tensor(batch.extend_prefix_lens_cpu) > 1]
        kept = table[rows, 0].clone()
        table[rows, 0] = table[rows, 1]
        try:
            return real(self, batch, padded_bs)
        finally:
            table[rows, 0] = kept

    monkeypatch.setattr(CudaGraphRunner, "replay", first_cached_token_from_the_second_slot)
    reports = _verify(dtype, steps=8, seed=3, graphs=("full",))
    assert {key for key, r in reports.items() if not r.ok} == {("DECODE", "whole_model")}


def test_in_bf16_the_tolerance_grows_by_the_models_own_distance_from_fp32_and_no_more():
    """Half precision: each step also runs an fp32 copy of the model; its
    distance from eager (the rounding of this model) widens the tolerance,
    float32 runs none."""
    reports = _verify(torch.bfloat16, steps=10, seed=1)
    assert all(r.ok for r in reports.values()), reports
    assert all(0 < r.noise < 0.5 for r in reports.values()), reports
    assert all(r.noise == 0 for r in _verify(steps=4, seed=1).values())


def test_verify_command_exits_zero_and_prints_the_table(capsys):
    assert main(["verify", "--device", "cpu", "--steps", "6", "--max-bs", "2", "--piece-compiler", "eager"]) == 0
    out = capsys.readouterr().out
    # Seed 0 draws 5 DECODE steps and 1 MIXED step; bs 3 > 2 decodes through pieces.
    for row in (
        "│ DECODE │ breakable   │     5 │",
        "│ DECODE │ whole_model │     4 │",
        "│ MIXED  │ piecewise   │     1 │",
    ):
        assert row in out
    assert "MISMATCH" not in out


@pytest.mark.parametrize("bad, name", [(["--steps", "0"], "steps"), (["--max-bs", "0"], "max_bs")])
def test_verify_rejects_non_positive_counts_with_the_reason(bad, name, capsys):
    assert main(["verify", "--device", "cpu", *bad]) == 2
    assert f"error: {name}: expected a positive int" in capsys.readouterr().out


def test_verify_needs_room_for_a_prefix_and_the_new_tokens():
    with pytest.raises(InvalidInputError, match="max_context_len: expected at least 18"):
        _verify(steps=1, max_context_len=10)


def test_verify_refuses_the_none_policy_it_would_check_nothing_with():
    with pytest.raises(InvalidInputError, match=r"graphs: expected policies among \['auto', 'full', 'piecewise', "
                                                r"'breakable'\], got \['none'\]"):  # fmt: skip
        _verify(steps=1, graphs=("none",))
