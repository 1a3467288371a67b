"""``FastLauncher``: Triton launches without ``JITFunction.run`` after the
first call of each specialisation, and exactly the kernel's results."""

import pytest
import torch

triton = pytest.importorskip("triton", reason="the launcher wraps Triton kernels")
tl = pytest.importorskip("triton.language")

from sgl_piecewise.internals.triton_launch import FastLauncher  # noqa: E402


@triton.jit
def _axpy(x, y, out, n, alpha, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out + i, alpha * tl.load(x + i, mask=m) + tl.load(y + i, mask=m), mask=m)


def _launch_and_want(launch, x, y, n):
    out = torch.full_like(x, float("nan"))
    launch((triton.cdiv(n, 128),), x, y, out, n, 2.0, BLOCK=128, num_warps=4)
    normal = torch.full_like(x, float("nan"))
    _axpy[(triton.cdiv(n, 128),)](x, y, normal, n, 2.0, BLOCK=128, num_warps=4)
    return out, normal


@pytest.mark.triton_cpu
def test_under_the_interpreter_the_launcher_launches_the_usual_way():
    launch = FastLauncher(_axpy)
    x, y = torch.randn(300), torch.randn(300)
    out, normal = _launch_and_want(launch, x, y, 300)
    assert not launch.fast
    torch.testing.assert_close(out, normal, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_the_launcher_reuses_the_compiled_kernel_per_specialisation_bit_for_bit():
    launch = FastLauncher(_axpy)
    x, y = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    for _ in range(3):  # the first launch goes through Triton, the others straight to the kernel
        out, normal = _launch_and_want(launch, x, y, 1000)
        torch.testing.assert_close(out, normal, rtol=0, atol=0)
    hooks = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
    assert launch.fast and len(launch._kernels) == 1, (launch.fast, launch._kernels, hooks)
    # Pointers off 16-byte alignment and another length: other specialisations,
    # each compiled (or found) by Triton first, then reused.
    for _ in range(2):
        out, normal = _launch_and_want(launch, x[1:], y[1:], 999)
        torch.testing.assert_close(out, normal, rtol=0, atol=0)
    assert len(launch._kernels) == 2


@pytest.mark.gpu
def test_gpu_a_launch_hook_sees_every_fast_launch():
    launch = FastLauncher(_axpy)
    x, y, out = torch.randn(256, device="cuda"), torch.randn(256, device="cuda"), torch.empty(256, device="cuda")
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    launch((2,), x, y, out, 256, 2.0, BLOCK=128)  # through Triton: compiles
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch((2,), x, y, out, 256, 2.0, BLOCK=128)  # the fast path
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    launch((2,), x, y, out, 256, 2.0, BLOCK=128)
    assert seen == ["_axpy"] and len(launch._kernels) == 1


@pytest.mark.gpu
def test_gpu_the_launcher_launches_on_the_current_stream_inside_a_cuda_graph():
    launch = FastLauncher(_axpy)
    x, y, out = torch.randn(256, device="cuda"), torch.randn(256, device="cuda"), torch.empty(256, device="cuda")
    launch((2,), x, y, out, 256, 2.0, BLOCK=128)  # first call: through Triton, outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch((2,), x, y, out, 256, 2.0, BLOCK=128)
    out.zero_()
    x.copy_(torch.randn(256, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, 2.0 * x + y)


@pytest.mark.gpu
def test_gpu_a_bound_kernel_takes_device_addresses_as_integers():
    launch = FastLauncher(_axpy)
    x, y = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    out, normal = _launch_and_want(launch, x, y, 1000)
    bound = launch.bound((x, y, out, 1000, 2.0), {"BLOCK": 128, "num_warps": 4})
    assert bound is not None
    by_address = torch.full_like(x, float("nan"))
    bound((8,), x.data_ptr(), y.data_ptr(), by_address.data_ptr(), 1000, 2.0)
    torch.testing.assert_close(by_address, normal, rtol=0, atol=0)
    # Another specialisation (a length not divisible by 16) was never launched: nothing bound.
    assert launch.bound((x, y, out, 999, 2.0), {"BLOCK": 128, "num_warps": 4}) is None


@triton.jit
def _scale(x, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out + i, 3.0 * tl.load(x + i, mask=m), mask=m)


@triton.jit
def _shift(x, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out + i, tl.load(x + i, mask=m) + 5.0, mask=m)


def _wait_ahead(launch) -> None:
    for future in list(launch._ahead.values()):
        future.result(timeout=300)


@pytest.mark.gpu
def test_gpu_variants_compile_ahead_on_a_background_thread_and_launch_bit_for_bit():
    import threading

    if not hasattr(triton.knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no jit_post_compile_hook to tell where a kernel compiled")
    launch = FastLauncher(_scale, variants=lambda meta: [{**meta, "BLOCK": 64}])
    x = torch.randn(1000, device="cuda")
    compiled_on = []

    def record(**kwargs):  # this kernel's compiles only: an earlier test's may still run in the background
        if getattr(kwargs.get("fn"), "name", "_scale") == "_scale":
            compiled_on.append(threading.current_thread().name)

    triton.knobs.runtime.jit_post_compile_hook = record
    try:
        first = torch.empty_like(x)
        launch((8,), x, first, 1000, BLOCK=128)
        _wait_ahead(launch)
        ahead = torch.full_like(x, float("nan"))
        launch((16,), x, ahead, 1000, BLOCK=64)  # compiled already: Triton finds it
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
    assert len(compiled_on) == 2 and compiled_on[0] == threading.current_thread().name, compiled_on
    assert compiled_on[1].startswith("sgl-piecewise-compile"), compiled_on
    normal = torch.full_like(x, float("nan"))
    _scale[(16,)](x, normal, 1000, BLOCK=64)
    torch.testing.assert_close(ahead, normal, rtol=0, atol=0)
    torch.testing.assert_close(first, 3.0 * x, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_compiling_ahead_during_a_graph_capture_leaves_the_capture_intact():
    # The background compiles must call nothing CUDA forbids while another
    # thread captures (torch captures in the "global" mode).
    launch = FastLauncher(_shift, variants=lambda meta: [{**meta, "BLOCK": b} for b in (32, 64, 256)])
    x, out = torch.randn(1000, device="cuda"), torch.empty(1000, device="cuda")
    launch((8,), x, out, 1000, BLOCK=128)  # compiles ahead from here on
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch((8,), x, out, 1000, BLOCK=128)
        _wait_ahead(launch)  # the compiles ran while this thread captured
    x.copy_(torch.randn(1000, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, x + 5.0, rtol=0, atol=0)
    for block in (32, 64, 256):  # each compiled ahead, and right
        other = torch.full_like(x, float("nan"))
        launch((triton.cdiv(1000, block),), x, other, 1000, BLOCK=block)
        torch.testing.assert_close(other, x + 5.0, rtol=0, atol=0)


def test_extend_row_tile_variants_are_the_launch_settings_shorter_queries_take():
    from sgl_piecewise.backends.triton_kernels.extend import extend_kernel_meta, row_tile_variants

    for heads, head_dim, dtype in [((14, 2), 64, torch.bfloat16), ((32, 8), 128, torch.float16),
                                   ((8, 1), 256, torch.bfloat16), ((8, 2), 128, torch.float32)]:  # fmt: skip
        metas = [extend_kernel_meta(*heads, head_dim, head_dim, dtype, q, False, True) for q in (1, 2, 4, 8, 16, 4096)]
        distinct = {tuple(sorted(m.items())) for m in metas}
        for meta in metas:
            variants = {tuple(sorted(v.items())) for v in row_tile_variants(meta)}
            assert variants == distinct - {tuple(sorted(meta.items()))}, (heads, head_dim, dtype, meta)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1000, 1])  # 1: an integer Triton turns into a constant
def test_gpu_a_kept_layer_launch_calls_the_launch_hooks_and_launches_on_the_current_stream(n):
    from sgl_piecewise.internals.triton_launch import StepLaunch

    x, y, out = (torch.randn(1000, device="cuda") for _ in range(3))
    meta = {"BLOCK": 128, "num_warps": 4}
    step = StepLaunch(FastLauncher(_axpy), (8,), (x, y, out, n, 2.0), meta, layer_positions=(0, 1, 2))
    step.launch(x, y, out, layer=0)  # through Triton: compiles, binds the kernel
    step.launch(x, y, out, layer=0)  # bound: keeps layer 0's launch
    assert step.kept_launch(0, (x, y, out)) is not None

    def again_writes_axpy():
        out.fill_(float("nan"))
        assert step.launch_again(0, x, y, out)
        torch.testing.assert_close(out[:n], 2.0 * x[:n] + y[:n], rtol=0, atol=0)
        assert out[n:].isnan().all()

    again_writes_axpy()
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        again_writes_axpy()  # a hook set: called as JITFunction.run calls it
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    again_writes_axpy()
    assert seen == ["_axpy"]
    # Inside a capture the kept launch goes to the capture's stream.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert step.launch_again(0, x, y, out)
    out.fill_(float("nan"))
    x.copy_(torch.randn(1000, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out[:n], 2.0 * x[:n] + y[:n], rtol=0, atol=0)
