"""``verify``: graph replay against eager on random ragged batches, and the
``sgl-piecewise verify`` command. It must pass on a correct stack, check
every path its policies offer, and fail on a broken one."""

from __future__ import annotations

from functools import partial

import pytest
from test_whole_model_runner import CONFIG

from sgl_piecewise.backends import create_backend
from sgl_piecewise.engine.cli import main
from sgl_piecewise.engine.verify import verify
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.models import build_random_model
from sgl_piecewise.runners.breakable import BreakableCudaGraphRunner
from sgl_piecewise.runners.whole_model import CudaGraphRunner

# Each compile here adds a Dynamo cache entry for the same model code; entries
# left by other tests must not push it past the recompile limit.
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _verify(**kw):
    model = build_random_model(CONFIG, seed=2, std=0.2)
    backend = partial(create_backend, "torch", num_q_heads=CONFIG.num_attention_heads)
    kw = {"max_bs": 4, "max_context_len": 96, "progress": False, "piece_compiler": "eager", **kw}
    return verify(model, backend, **kw)


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
