"""``benchmarks/bench_host_time.py`` (a GPU script) runs end to end on the
CPU, timing each row's graph paths over every round it was asked for, and
leaves the process's cores as it found them."""

from __future__ import annotations

import json
import os

import pytest


def test_tiny_run_times_each_rows_graph_paths_in_every_round(load_benchmark, tmp_path):
    argv = ["--device", "cpu", "--shape", "tiny", "--context", "16", "--decode-bs", "1", "2", "--extend", "4"]
    argv += ["--rounds", "2", "--iters", "3", "--core", "0", "--out", str(tmp_path)]
    cores = os.sched_getaffinity(0)
    result = load_benchmark("bench_host_time").main(argv)
    assert os.sched_getaffinity(0) == cores  # the pin to one core ends with the timing
    assert json.loads((tmp_path / "host_tiny.json").read_text()) == result
    paths = {row: sorted(times) for row, times in result["rows"].items()}
    assert paths == {
        "decode 1": ["piecewise", "whole_model"],
        "decode 2": ["piecewise", "whole_model"],
        "extend 4": ["piecewise"],
    }
    for times in (t for row in result["rows"].values() for t in row.values()):
        assert times["samples"] == 2 * 3
        assert 0 < times["host_min_ms"] <= times["host_p10_ms"] <= times["host_median_ms"]


def test_no_round_or_a_core_the_process_cannot_run_on_is_refused_before_any_work(load_benchmark, tmp_path, capsys):
    bench = load_benchmark("bench_host_time")
    for bad, message in (
        ("--rounds=0", "--rounds and --iters: expected at least 1"),
        ("--core=4096", "--core: expected one of"),
    ):
        with pytest.raises(SystemExit):
            bench.main(["--device", "cpu", "--shape", "tiny", bad, "--out", str(tmp_path)])
        assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
