"""``benchmarks/bench_backend_hops.py`` (a GPU script) runs end to end on the
CPU: every timed path ran, their logits agree, and the hop was measured."""

from __future__ import annotations

import json


def test_tiny_run_times_both_graph_paths_and_the_hop_of_each_batch_size(load_benchmark, tmp_path):
    argv = ["--device", "cpu", "--shape", "tiny", "--backends", "torch", "--decode-bs", "1", "2",
            "--context", "16", "--rounds", "1", "--out", str(tmp_path)]  # fmt: skip
    result = load_benchmark("bench_backend_hops").main(argv)
    assert json.loads((tmp_path / "backend_hops.json").read_text()) == json.loads(json.dumps(result))
    rows = result["backends"]["torch"]
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        assert row["piecewise"] > 0 and row["whole_model"] > 0 and row["hop_us_per_layer"] > 0
        assert row["whole_model_maxdiff"] < 1e-4  # fp32: the two graph paths give the same logits
