"""The Triton internals (``sgl_piecewise/internals/triton_*.py``): each one's
import-time check holds on the installed Triton (a Triton that breaks one
fails here rather than launching slower unnoticed), and each fallback,
forced, still gives the right results."""

from __future__ import annotations

import random

import pytest
import torch

triton = pytest.importorskip("triton", reason="the Triton internals wrap Triton")
tl = pytest.importorskip("triton.language")

from test_backends_differential import (  # noqa: E402
    ATOL_BF16,
    ATOL_F32,
    CASES,
    GPU_HEAD_DIM,
    MAX_BS,
    assert_close,
    draw_batch,
    eager,
    make_backend,
    make_pools,
    random_qkv,
)

from sgl_piecewise.backends import ReferenceBackend  # noqa: E402
from sgl_piecewise.internals import triton_jit, triton_launch  # noqa: E402

ON_CPU = pytest.param("cpu", marks=pytest.mark.triton_cpu)
ON_GPU = pytest.param("cuda", marks=pytest.mark.gpu)


def test_the_internals_the_launcher_and_the_interpreter_check_use_are_there_on_the_installed_triton():
    assert triton_jit.AVAILABLE, triton_jit.UNAVAILABLE_REASON
    assert triton_launch.AVAILABLE, triton_launch.UNAVAILABLE_REASON
    assert triton_jit.UNAVAILABLE_REASON == triton_launch.UNAVAILABLE_REASON == ""


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU build of torch has no CUDA stream getters")
def test_torch_s_raw_stream_getters_are_there_on_a_cuda_build():
    assert triton_launch.RAW_STREAM


# ---- triton_jit: the class check, else TRITON_INTERPRET ---------------------
def _our_kernels():
    from sgl_piecewise.backends.triton_kernels import decode, extend, metadata_fill, store_kv
    from sgl_piecewise.ops.kernels import elementwise

    return [decode._decode_kernel, extend._extend_kernel, store_kv._store_kv_kernel, metadata_fill._fill_kernel,
            elementwise._rms_norm_kernel]  # fmt: skip


def test_without_the_class_check_interpreted_and_compiled_kernels_are_still_told_apart(monkeypatch):
    kernels = _our_kernels()
    by_class = [triton_jit.runs_compiled(k) for k in kernels]
    assert len(set(by_class)) == 1  # all decorated under the same switch
    assert by_class[0] == (not triton_jit.interpreter_requested())
    monkeypatch.setattr(triton_jit, "AVAILABLE", False)
    assert [triton_jit.runs_compiled(k) for k in kernels] == by_class


TRITON_INTERPRET_VALUES = [("1", True), ("true", True), (" ON ", True), ("y", True),
                           ("0", False), ("", False), ("off", False), (None, False)]  # fmt: skip


@pytest.mark.parametrize(("value", "interpreted"), TRITON_INTERPRET_VALUES)
def test_the_fallback_reads_triton_interpret_as_triton_does(monkeypatch, value, interpreted):
    monkeypatch.setattr(triton_jit, "AVAILABLE", False)
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_jit.interpreter_requested() is interpreted
    assert triton_jit.runs_compiled(object()) is not interpreted


# ---- triton_launch: kernel[grid] for every launch ---------------------------
def _forbid_the_fast_path(monkeypatch):
    def fast_launch(*args, **kwargs):
        raise AssertionError("a launch went through a BoundKernel with the fast launcher off")

    monkeypatch.setattr(triton_launch.BoundKernel, "__call__", fast_launch)


def _pools(device: str):
    return make_pools() if device == "cpu" else make_pools("cuda", torch.bfloat16, GPU_HEAD_DIM)


def _attend(pools, case, seed: str):
    """The triton backend's and the reference backend's outputs, two layers
    of two fresh batches through one backend (the second step's launches
    are the bound ones where the fast launcher is on)."""
    rng = random.Random(seed)
    backend, ref = make_backend("triton", pools), ReferenceBackend(pools.req, pools.kv)
    got, want = [], []
    for _ in range(2):
        batch = draw_batch(pools, case, rng.randint(1, MAX_BS), rng)
        qkv = random_qkv(batch.num_tokens, pools, torch.Generator().manual_seed(rng.randrange(2**31)))
        got += eager(backend, batch, qkv)
        want += eager(ref, batch, qkv)
    return got, want


# Decode (the decode kernel, writing its K/V), extend (the extend kernel
# writing its K/V), mixed and tree-masked verify (the store kernel, then
# the extend kernel; with a mask).
FALLBACK_CASES = [c for c in CASES if c.id in ("decode", "extend_prefix", "mixed", "verify_tree_mask")]


@pytest.mark.parametrize("case", FALLBACK_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("device", [ON_CPU, ON_GPU])
def test_with_the_fast_launcher_off_the_triton_backend_still_matches_the_reference(monkeypatch, device, case):
    seed = f"fallback-{case.id}"
    fast = _attend(_pools(device), case, seed)[0] if device == "cuda" else None
    monkeypatch.setattr(triton_launch, "AVAILABLE", False)
    _forbid_the_fast_path(monkeypatch)
    got, want = _attend(_pools(device), case, seed)
    assert_close(got, want, ATOL_F32 if device == "cpu" else ATOL_BF16)
    if fast is not None:  # the same compiled kernels, launched either way: the same bits
        for f, g in zip(fast, got):
            torch.testing.assert_close(g, f, rtol=0, atol=0)


@triton.jit
def _axpy(x, y, out, n, alpha, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out + i, alpha * tl.load(x + i, mask=m) + tl.load(y + i, mask=m), mask=m)


@pytest.mark.parametrize("device", [ON_CPU, ON_GPU])
def test_with_the_fast_launcher_off_a_launcher_binds_nothing_and_launches_through_kernel_grid(monkeypatch, device):
    monkeypatch.setattr(triton_launch, "AVAILABLE", False)
    _forbid_the_fast_path(monkeypatch)
    launch = triton_launch.FastLauncher(_axpy)
    step = triton_launch.StepLaunch(launch, (8,), (None, None, None, 1000, 2.0), {"BLOCK": 128},
                                    layer_positions=(0, 1, 2))  # fmt: skip
    x, y = torch.randn(1000, device=device), torch.randn(1000, device=device)
    for _ in range(3):
        out = torch.full_like(x, float("nan"))
        step.launch(x, y, out, layer=0)
        torch.testing.assert_close(out, 2.0 * x + y)
        assert not step.launch_again(0, x, y, out)  # nothing kept to launch again
    assert launch._kernels == {} and launch.bound((x, y, out, 1000, 2.0), {"BLOCK": 128}) is None


@pytest.mark.gpu
def test_with_torch_s_public_stream_getters_launches_go_to_the_current_stream_inside_a_cuda_graph(monkeypatch):
    monkeypatch.setattr(triton_launch, "current_stream", triton_launch._public_current_stream)
    monkeypatch.setattr(triton_launch, "current_device", triton_launch._public_current_device)
    launch = triton_launch.FastLauncher(_axpy)
    x, y, out = (torch.randn(1000, device="cuda") for _ in range(3))
    launch((8,), x, y, out, 1000, 2.0, BLOCK=128)  # compiles, binds
    assert launch.bound((x, y, out, 1000, 2.0), {"BLOCK": 128}) is not None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # on a side stream: a launch to any other would break the capture
        launch((8,), x, y, out, 1000, 2.0, BLOCK=128)
    out.fill_(float("nan"))
    x.copy_(torch.randn(1000, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, 2.0 * x + y, rtol=0, atol=0)
