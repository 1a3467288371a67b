"""``benchmarks/bench_speculative.py`` (run on an H200 later) in its CPU
smoke mode: a tiny model, every kind of draft, the JSON it writes."""

from __future__ import annotations

import json


def test_the_cpu_smoke_run_measures_every_draft_and_writes_json(load_benchmark, tmp_path):
    argv = ["--device", "cpu", "--tiny", "--out", str(tmp_path), "--batch-sizes", "2", "--prompt-len", "4",
            "--new-tokens", "6", "--drafts", "self:2,self-layers:2:2,random:2"]  # fmt: skip
    load_benchmark("bench_speculative").main(argv)
    result = json.loads((tmp_path / "speculative.json").read_text())
    assert result["dtype"] == "torch.float32" and result["backend"] == "torch"
    runs = {(r["batch_size"], r["draft"]): r for r in result["runs"]}
    assert set(runs) == {(2, d) for d in ("self:2", "self-layers:2:2", "random:2")}
    assert all(r["identical_tokens"] and r["graphs"] and not r["eager_fallbacks"] for r in runs.values())
    # The target as its own draft: 5 tokens after the prefill in ceil(5 / 3) = 2 verify steps.
    assert runs[(2, "self:2")]["acceptance_rate"] == 1.0 and runs[(2, "self:2")]["verify_steps"] == 2
    assert all(r["plain_tokens_per_s"] > 0 and r["speculative_tokens_per_s"] > 0 for r in runs.values())
