"""``verify``: graph replay against eager on random ragged batches, and the
``sgl-piecewise verify`` command. It must pass on a correct stack and fail
on a broken one."""

from __future__ import annotations

from functools import partial

import pytest
from test_whole_model_runner import CONFIG

from sgl_piecewise.backends import create_backend
from sgl_piecewise.cli import main
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.models import build_random_model
from sgl_piecewise.runners.whole_model import CudaGraphRunner
from sgl_piecewise.verify import verify


def _verify(**kw):
    model = build_random_model(CONFIG, seed=2, std=0.2)
    backend = partial(create_backend, "torch", num_q_heads=CONFIG.num_attention_heads)
    return verify(model, backend, **{"max_bs": 4, "max_context_len": 96, "progress": False, **kw})


def test_a_correct_stack_passes_in_every_mode_and_the_fallback_runs():
    reports = _verify(steps=30, seed=1)
    assert all(r.ok for r in reports.values()), reports
    assert sum(r.steps for r in reports.values()) == 30
    assert all(r.steps for r in reports.values())
    assert reports["DECODE"].fallbacks == reports["DECODE"].sizes.count(5) > 0  # bs 5 > max_bs 4


def test_a_graph_runner_that_returns_wrong_hidden_states_fails(monkeypatch):
    real = CudaGraphRunner.try_replay

    def off_by_a_bit(self, batch):
        hidden = real(self, batch)
        return None if hidden is None else hidden + 1e-2

    monkeypatch.setattr(CudaGraphRunner, "try_replay", off_by_a_bit)
    reports = _verify(steps=12, seed=3)
    assert reports["EXTEND"].ok and not reports["DECODE"].ok


def test_verify_command_exits_zero_and_prints_the_table(capsys):
    assert main(["verify", "--device", "cpu", "--steps", "6", "--max-bs", "2"]) == 0
    out = capsys.readouterr().out
    assert "DECODE" in out and "EXTEND" in out and "MISMATCH" not in out


@pytest.mark.parametrize("bad, name", [(["--steps", "0"], "steps"), (["--max-bs", "0"], "max_bs")])
def test_verify_rejects_non_positive_counts_with_the_reason(bad, name, capsys):
    assert main(["verify", "--device", "cpu", *bad]) == 2
    assert f"error: {name}: expected a positive int" in capsys.readouterr().out


def test_verify_needs_room_for_a_prefix_and_the_new_tokens():
    with pytest.raises(InvalidInputError, match="max_context_len: expected at least 18"):
        _verify(steps=1, max_context_len=10)
