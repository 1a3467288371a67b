"""``sgl-piecewise bench --draft SPEC``: plain greedy against speculative
decoding on the CPU, end to end."""

from __future__ import annotations

import re

import pytest

from sgl_piecewise.engine.cli import main

SMALL = ["--model", "random", "--device", "cpu", "--batch-size", "3", "--prompt-len", "6", "--new-tokens", "8"]


def test_bench_with_the_target_as_draft_accepts_everything_and_agrees(capsys):
    assert main(["bench", "--draft", "self:3", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "whole-model graphs on" in out
    # 8 tokens: 1 from the prefill, 7 in ceil(7 / 4) = 2 verify steps; 7 plain decode steps.
    assert re.search(r"plain greedy\s*│\s*[\d.]+\s*│\s*1\.00x\s*│\s*-\s*│\s*7 │", out), out
    assert re.search(r"speculative\s*│\s*[\d.]+\s*│\s*[\d.]+x\s*│\s*1\.00\s*│\s*2 │", out), out
    assert "check: identical tokens; eager fallbacks: none" in out


def test_bench_without_graph_hooks_runs_both_eagerly(capsys):
    argv = ["bench", "--draft", "random:1", "--backend", "reference", *SMALL]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "whole-model graphs off (no graph hooks)" in out and "check: identical tokens" in out


def test_bench_with_graphs_none_runs_both_eagerly_and_the_title_names_the_tp_size(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["bench", "--draft", "self:3", "--graphs", "none", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "whole-model graphs off |" in out and "sgl-piecewise bench --draft self:3 (tp 1)" in out
    assert re.search(r"│ none +│ speculative +│", out), out
    assert "check: identical tokens" in out


def test_draft_help_names_the_flags_that_exist(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--modes" not in text
    assert "--graphs then among full, none" in text


@pytest.mark.parametrize("graphs", ["auto", "none,piecewise", "breakable"])
def test_a_policy_the_speculative_runner_lacks_is_refused_before_the_model_loads(graphs, capsys, monkeypatch):
    import sgl_piecewise.models.loader as loader

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded before --graphs was checked")

    monkeypatch.setattr(loader, "load_model_or_default", must_not_load)
    assert main(["bench", "--draft", "self:2", "--graphs", graphs, *SMALL]) == 2
    assert capsys.readouterr().out == (
        f"error: --graphs with --draft: expected a comma-separated subset of ('full', 'none'), got {graphs!r}\n"
    )


@pytest.mark.parametrize("draft", ["self", "self-layers:2", "eagle:3", "self:0"])
def test_a_bad_draft_is_refused_before_the_model_loads(draft, capsys, monkeypatch):
    import sgl_piecewise.models.loader as loader

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded before --draft was checked")

    monkeypatch.setattr(loader, "load_model_or_default", must_not_load)
    assert main(["bench", "--draft", draft, "--device", "cpu"]) == 2
    out = capsys.readouterr().out
    assert "error: --draft: expected self:K, self-layers:N:K or random:K" in out and repr(draft) in out
