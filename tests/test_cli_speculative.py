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


@pytest.mark.parametrize("draft", ["self", "self-layers:2", "eagle:3", "self:0"])
def test_a_bad_draft_is_refused_before_the_model_loads(draft, capsys, monkeypatch):
    import sgl_piecewise.models.loader as loader

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded before --draft was checked")

    monkeypatch.setattr(loader, "load_model_or_default", must_not_load)
    assert main(["bench", "--draft", draft, "--device", "cpu"]) == 2
    out = capsys.readouterr().out
    assert "error: --draft: expected self:K, self-layers:N:K or random:K" in out and repr(draft) in out
