"""The command-line main job (README's first command), end to end on the CPU."""

from __future__ import annotations

import pytest

from sgl_piecewise.cli import main


def test_bench_runs_every_mode_and_they_agree(capsys):
    argv = ["bench", "--device", "cpu", "--batch-size", "3", "--prompt-len", "10",
            "--new-tokens", "4", "--max-capture-size", "16"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    for mode in ("eager", "compiled", "graphs", "decode-graphs"):
        assert mode in out
    assert "decode-graphs vs eager: 12/12 generated tokens identical" in out
    assert "check: outputs agree" in out


def test_bench_rejects_unknown_modes_naming_the_valid_ones():
    with pytest.raises(SystemExit, match=r"--modes: expected a subset of .*decode-graphs"):
        main(["bench", "--device", "cpu", "--modes", "eager,turbo"])


@pytest.mark.parametrize("flag", ["--batch-size", "--prompt-len", "--new-tokens", "--max-capture-size"])
def test_bench_rejects_non_positive_sizes_with_the_reason(flag, capsys):
    assert main(["bench", "--device", "cpu", flag, "0"]) == 2
    assert f"error: {flag}: expected a positive int, got 0" in capsys.readouterr().out
