"""``benchmarks/bench_all_reduce.py``: one-shot and two-shot against NCCL inside CUDA
graphs on two GPUs; refused, naming what is missing, elsewhere."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch


def test_without_two_gpus_the_sweep_is_refused_naming_what_it_found(load_benchmark, tmp_path, capsys):
    if torch.cuda.device_count() >= 2:
        pytest.skip("two CUDA devices are here: the GPU test runs the sweep")
    bench = load_benchmark("bench_all_reduce")
    with pytest.raises(SystemExit) as ended:
        bench.main(["--out", str(tmp_path)])
    assert ended.value.code == 2
    assert (
        f"expected 2 CUDA devices and symmetric memory, got {torch.cuda.device_count()} devices"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "all_reduce_sweep.json").exists()


@pytest.mark.gpu
def test_gpu_sweep_times_every_path_and_each_sums_right(load_benchmark, tmp_path, monkeypatch):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    bench = load_benchmark("bench_all_reduce")
    monkeypatch.setitem(sys.modules, "bench_all_reduce", bench)  # the spawned ranks import it by name
    result = bench.main(["--elements", "896", "65536", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "all_reduce_sweep.json").read_text()) == json.loads(json.dumps(result))
    assert sorted((r["elements"], r["path"]) for r in result["rows"]) == sorted(
        (n, path) for n in (896, 65536) for path in bench.paths()
    )
    assert {"one_shot", "one_shot_copy_op", "nccl"} <= set(bench.paths())
    assert all(r["ok"] and r["us_per_all_reduce"] > 0 for r in result["rows"])


@pytest.mark.gpu
def test_gpu_fused_norm_rows_time_both_paths_and_flashinfer_agrees_with_the_library(
    load_benchmark, tmp_path, monkeypatch
):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    pytest.importorskip("flashinfer")
    bench = load_benchmark("bench_all_reduce")
    monkeypatch.setitem(sys.modules, "bench_all_reduce", bench)
    result = bench.main(["--elements", "896", "--fused-norm", "--out", str(tmp_path)])
    rows = result["fused_norm_rows"]
    assert sorted((r["hidden"], r["tokens"], r["path"]) for r in rows) == sorted(
        (h, t, path) for h in bench.FUSED_HIDDEN for t in bench.FUSED_TOKENS for path in bench.FUSED_PATHS
    )
    assert all(r["us_per_call"] > 0 for r in rows)
    # The same sums and adds (each rounded once to bf16); the fused norm rounds once where the
    # library's rounds twice: a unit in the last place apart at most; a wrong sum or a missing
    # residual is off by the whole scale.
    assert all(r["max_diff_over_scale"] < 0.05 for r in rows)
    assert all(r["max_diff_over_scale"] == 0 for r in rows if r["path"] == "one_shot_then_norm")


def test_fused_norm_without_flashinfer_is_refused_naming_it(load_benchmark, tmp_path, capsys):
    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("flashinfer is installed here")
    bench = load_benchmark("bench_all_reduce")
    with pytest.raises(SystemExit) as ended:
        bench.main(["--fused-norm", "--out", str(tmp_path)])
    assert ended.value.code == 2
    assert "--fused-norm: expected the flashinfer package, got none installed" in capsys.readouterr().err
    assert not (tmp_path / "all_reduce_sweep.json").exists()
