"""``benchmarks/bench_runners.py`` (a GPU script) runs end to end on the CPU
with ``--tiny``, and every timed step takes the path its policy says: a GPU
run cannot silently time a fallback."""

from __future__ import annotations

import json


def test_tiny_run_times_every_shape_on_the_path_its_policy_takes(load_benchmark, tmp_path, capsys):
    result = load_benchmark("bench_runners").main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--iters", "1"])
    assert json.loads((tmp_path / "runners.json").read_text()) == result
    decode, extend = ["decode bs 1", "decode bs 2", "decode bs 4"], ["extend 4", "extend 8", "extend 16"]
    # Captured sizes are exactly the timed ones, so every step is served.
    expected = {
        "none": dict.fromkeys(decode + extend, "eager"),
        "full": {**dict.fromkeys(decode, "whole_model"), **dict.fromkeys(extend, "eager")},
        "piecewise": dict.fromkeys(decode + extend, "piecewise"),
        "breakable": dict.fromkeys(decode + extend, "breakable"),
        "auto": {**dict.fromkeys(decode, "whole_model"), **dict.fromkeys(extend, "piecewise")},
    }
    got = {
        policy: {shape: step["path"] for shape, step in r["steps"].items()} for policy, r in result["policies"].items()
    }
    assert got == expected
    assert all(step["ms"] > 0 for r in result["policies"].values() for step in r["steps"].values())
    assert result["policies"]["auto"]["captured"] == {
        "piecewise": "5 sizes, tokens 1..16",  # decode 1, 2, 4 and extend 4, 8, 16 tokens
        "whole_model": "3 sizes, bs 1..4, the compiled model",
    }
