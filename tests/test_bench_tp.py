"""``benchmarks/bench_tp.py`` (a script for two GPUs) runs end to end on the
CPU over gloo ranks: TP 1 and TP 2, each timed path served by the graphs
its policy captured, every row in the JSON with its ratio to TP 1."""

from __future__ import annotations

import json
import sys

import pytest


def test_tiny_run_over_gloo_records_every_row(load_benchmark, tmp_path, monkeypatch):
    bench = load_benchmark("bench_tp")
    # The ranks are spawned and import the rank function by its module's name.
    monkeypatch.setitem(sys.modules, "bench_tp", bench)
    argv = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--tp", "1", "2", "--decode-bs", "1", "2",
            "--context", "16", "--iters", "2", "--timeout", "300", "--sequence-parallel", "both",
            "--shard-alone", "2", "--out", str(tmp_path)]  # fmt: skip
    result = bench.main(argv)

    saved = json.loads((tmp_path / "bench_tp_tiny.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["launch_errors"] == []
    assert saved["card"] == "cpu" and saved["torch"] and saved["date"]
    rows = {(r["tp"], r["sp"], r["shard_of"], r["comm"], r["path"], r["bs"]): r for r in saved["rows"]}
    # At TP 2 on the CPU the one all-reduce path is gloo (no symmetric memory);
    # TP 2 runs without and with sequence parallelism; one rank's shard of
    # TP 2 runs alone, with no communication.
    assert sorted(rows, key=str) == sorted(
        ((tp, sp, shard_of, comm, path, bs)
         for tp, sp, shard_of, comm in ((1, False, None, "none"), (2, False, None, "gloo"), (2, True, None, "gloo"),
                                        (1, False, 2, "none"))
         for path in ("whole_model", "piecewise")
         for bs in (1, 2)), key=str,
    )  # fmt: skip
    for (tp, _, shard_of, _, path, _), row in rows.items():
        assert "error" not in row, row
        assert row["ms"] > 0 and row["step_path"] == path
        assert row["ratio_to_tp1"] == pytest.approx(row["ms"] / rows[(1, False, None, "none", path, row["bs"])]["ms"])
        assert row["kv_pool_heads"] == 2 // (shard_of or tp)  # the KV pool holds this rank's heads
    assert saved["ranks"]["2"]["num_local_heads"] == 2 and saved["ranks"]["2"]["symmetric_buffer_bytes"] == 0
    assert "2+sp" in saved["ranks"]
    # The shard alone holds what a rank of TP 2 holds, as a model of one rank.
    assert saved["ranks"]["1/2"]["num_local_heads"] == 2 and saved["ranks"]["1/2"]["symmetric_buffer_bytes"] == 0


def test_idle_time_counts_only_the_gaps_no_span_covers_and_names_their_neighbours(load_benchmark):
    bench = load_benchmark("bench_tp")
    # Overlapping and nested spans cover [0, 8] and [10, 12]; gaps 8-10 and 12-20.
    spans = [(10, 12, "c"), (0, 5, "a"), (3, 8, "b"), (11, 11.5, "d"), (20, 21, "e")]
    assert bench.idle_us(spans) == 10
    assert bench.idle_gaps(spans) == [(8, "c", "e"), (2, "b", "c")]  # the nested d ends inside c
    assert bench.idle_us([(0, 4), (4, 6)]) == 0 and bench.idle_us([]) == 0


def test_kernels_fall_in_the_first_class_whose_mark_their_name_holds(load_benchmark):
    bench = load_benchmark("bench_tp")
    assert bench.kernel_class("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_splitK_TNT") == "matmul"
    assert bench.kernel_class("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "matmul"
    assert bench.kernel_class("_decode_kernel") == "attention"
    assert bench.kernel_class("_rms_norm_kernel") == "norm"
    # A fused all-reduce + RMSNorm kernel counts as the collective it waits in.
    assert bench.kernel_class("allreduce_fusion_kernel_oneshot_lamport<RMSNorm>") == "collective"
    assert bench.kernel_class("void at::native::vectorized_elementwise_kernel<4, add>") == "other"


def test_the_fused_ops_time_tp1_and_a_shard_alone_and_refuse_several_ranks(load_benchmark, tmp_path, monkeypatch):
    bench = load_benchmark("bench_tp")
    monkeypatch.setitem(sys.modules, "bench_tp", bench)
    argv = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--tp", "1", "--decode-bs", "1",
            "--context", "16", "--iters", "1", "--paths", "whole_model", "--shard-alone", "2",
            "--fused-projections", "--out", str(tmp_path)]  # fmt: skip
    saved = json.loads(json.dumps(bench.main(argv)))
    assert saved["launch_errors"] == []
    assert {(r["shard_of"], r["path"], r["bs"]) for r in saved["rows"] if r["ms"] > 0} == {
        (None, "whole_model", 1),
        (2, "whole_model", 1),
    }
    # The model, each of its layers and the LM head (1 + 2 + 1 in the tiny shape), in both launches.
    assert saved["ranks"]["1"]["fused_projection_modules"] == saved["ranks"]["1/2"]["fused_projection_modules"] == 4
    with pytest.raises(SystemExit):
        bench.parse_args(["--tp", "1", "2", "--fused-projections", "--out", str(tmp_path)])
