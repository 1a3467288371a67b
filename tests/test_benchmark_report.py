"""The benchmark suite's report turns run files into the table and the plot
(the measuring itself runs on a GPU, not here)."""

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from suite_report import report  # noqa: E402


def run_file(shape: str) -> dict:
    decode = {str(bs): {"eager": 20.0, "piecewise": 4.0, "whole_model": 1.0 + bs / 100, "floor": 0.25,
                        "whole_model_kernels_per_layer": 11.5} for bs in (1, 8)}  # fmt: skip
    decode["8"]["reduce_overhead"] = None  # a path that failed
    decode["1"]["whole_model_profile"] = {"own_us_by_class": {"projection": 856.0, "attention": 130.4},
                                          "span_us": 996.2}  # fmt: skip
    return {
        "shape": shape, "card": "NVIDIA H200", "torch": "2.11.0", "backend": "triton", "date": "2026-11-26",
        "config": {"num_hidden_layers": 16},
        "decode": decode, "extend": {"16": {"eager": 19.0, "piecewise": 3.0, "floor": 0.3}},
        "startup": {"seconds": 17.0, "first_size_seconds": 12.0, "sizes": 52, "reserved_delta_gib": 0.1},
    }  # fmt: skip


def test_report_writes_a_table_of_ratios_to_the_floor_and_a_plot(tmp_path):
    for shape in ("0.5b", "1b"):
        (tmp_path / f"suite_{shape}.json").write_text(json.dumps(run_file(shape)))
    warm = {"startup": {"seconds": 3.0, "first_size_seconds": 1.5, "sizes": 52, "reserved_delta_gib": 0.1}}
    (tmp_path / "startup_0.5b.json").write_text(json.dumps(warm))
    report(str(tmp_path), str(tmp_path / "out"))
    text = (tmp_path / "out" / "suite.md").read_text()
    assert "| 1 | 0.250 | 20.00 (80.0×) | failed |" not in text  # bs 1 had no reduce-overhead run
    assert "| 8 | 0.250 | 20.00 (80.0×) | failed | 4.00 (16.0×) | 1.08 (4.3×) |" in text
    assert "| 1 | 11.5 | — |" in text  # kernels per layer: whole_model's, no whole_model_pieces run
    assert "| piecewise, 2nd process | 52 | 3.0 | 1.5 | 0.100 GiB |" in text
    # Own µs per layer by kernel class, from the batches that have a profile (bs 1 here).
    assert "| own µs per layer, whole-model replay | bs 1 |" in text
    assert "| attention | 8.2 |" in text and "| projection | 53.5 |" in text
    assert "| replay span, µs a step | 996 |" in text
    assert (tmp_path / "out" / "suite.png").stat().st_size > 10_000
