"""``FastLauncher``: Triton launches without ``JITFunction.run`` after the
first call of each specialisation, and exactly the kernel's results."""

import pytest
import torch

triton = pytest.importorskip("triton", reason="the launcher wraps Triton kernels")
tl = pytest.importorskip("triton.language")

from sgl_piecewise.backends.triton_kernels.launch import FastLauncher  # noqa: E402


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
    triton.knobs.runtime.jit_post_compile_hook = lambda **_: compiled_on.append(threading.current_thread().name)
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


# ---- launches through the CUDA driver, arguments packed once ----------------

from sgl_piecewise.backends.triton_kernels import driver_launch as dl  # noqa: E402
from sgl_piecewise.backends.triton_kernels.launch import StepLaunch  # noqa: E402


def test_param_layout_packs_the_arguments_triton_passes_in_order():
    # _axpy(x, y, out, n, alpha, BLOCK): n == 1 would have been specialised
    # to a constexpr by Triton, and is then no parameter.
    layout = dl.param_layout(["*fp32", "*fp32", "*bf16", "i32", "fp32", "constexpr"], 5)
    assert layout.arg_positions == (0, 1, 2, 3, 4)
    assert layout.ctypes == (dl._POINTER,) * 3 + (dl.ctypes.c_int32, dl.ctypes.c_float)
    one = dl.param_layout(["*fp32", "*fp32", "*fp32", "constexpr", "fp32", "constexpr"], 5)
    assert one.arg_positions == (0, 1, 2, 4)


@pytest.mark.parametrize(
    "signature,num_args,why",
    [
        (["*fp32", "i32", "constexpr"], 1, "a runtime argument the launch does not give"),
        (["*fp32", ("i32", "i32")], 2, "a tuple argument"),
        (["*fp32", "fp16"], 2, "an fp16 scalar: Triton packs it by hand"),
        (["tensordesc<fp16[64, 64]>"], 1, "a tensor descriptor"),
    ],
)
def test_param_layout_refuses_what_it_does_not_pack_like_triton(signature, num_args, why):
    assert dl.param_layout(signature, num_args) is None, why


def test_packed_values_are_refused_where_triton_would_raise_or_ctypes_truncate():
    assert dl.packed_value(dl.ctypes.c_int32, 2**31 - 1).value == 2**31 - 1
    assert dl.packed_value(dl.ctypes.c_int32, 2**31) is None  # ctypes alone would wrap it to -2**31
    assert dl.packed_value(dl.ctypes.c_int64, -(2**40)).value == -(2**40)
    assert dl.packed_value(dl._POINTER, 2**64) is None and dl.packed_value(dl._POINTER, -16) is None
    assert dl.packed_value(dl.ctypes.c_int32, 3.0) is None  # a float for an int parameter
    assert dl.packed_value(dl.ctypes.c_float, True) is None
    assert dl.packed_value(dl.ctypes.c_float, 0.1).value == pytest.approx(0.1, rel=1e-7)


@pytest.mark.gpu
def test_gpu_a_step_launch_goes_through_the_driver_bit_for_bit():
    x = torch.randn(1000, device="cuda")
    ys = [torch.randn(1000, device="cuda") for _ in range(3)]
    outs = [torch.full_like(x, float("nan")) for _ in range(3)]
    step = StepLaunch(FastLauncher(_axpy), (8,), (x, ys[0], outs[0], 1000, 2.0), {"BLOCK": 128},
                      layer_positions=(1, 2))  # fmt: skip
    for y, out in zip(ys, outs):  # the first through Triton, the others through the driver
        step.launch(y, out)
    assert step._driver is not None, "the driver launch must be in use on this card"
    for y, out in zip(ys, outs):
        normal = torch.full_like(x, float("nan"))
        _axpy[(8,)](x, y, normal, 1000, 2.0, BLOCK=128)
        torch.testing.assert_close(out, normal, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_a_driver_launch_is_captured_on_the_current_stream_and_replays_new_data():
    x, y, out = (torch.randn(256, device="cuda") for _ in range(3))
    step = StepLaunch(FastLauncher(_axpy), (2,), (x, y, out, 256, 3.0), {"BLOCK": 128}, layer_positions=(2,))
    step.launch(out)  # through Triton, outside the graph; binds the driver launch
    assert step._driver is not None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.launch(out)
    out.zero_()
    x.copy_(torch.randn(256, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, 3.0 * x + y, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_with_a_launch_hook_set_a_step_launch_goes_through_triton_which_calls_it():
    x, y, out = (torch.randn(256, device="cuda") for _ in range(3))
    step = StepLaunch(FastLauncher(_axpy), (2,), (x, y, out, 256, 2.0), {"BLOCK": 128}, layer_positions=(2,))
    step.launch(out)
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        step.launch(out)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["_axpy"]


@pytest.mark.gpu
def test_gpu_a_layout_is_admitted_only_where_the_driver_records_the_same_parameters():
    x, y, out = (torch.randn(256, device="cuda") for _ in range(3))
    launcher = FastLauncher(_axpy)
    launcher((2,), x, y, out, 256, 2.0, BLOCK=128)
    kernel = launcher.bound((x, y, out, 256, 2.0), {"BLOCK": 128}).kernel
    layout = dl.kernel_layout(kernel, 5)
    assert layout is not None and layout.num_scratch <= dl._MAX_SCRATCH
    # Three pointers, an i32, an f32, then Triton's scratch pointers.
    assert dl._driver().params(kernel.function, 10) == (8, 8, 8, 4, 4) + (8,) * layout.num_scratch
    signature = dict(kernel.src.signature)
    kernel.src.signature = {**signature, "n": "i64"}  # a layout of an i64 where the kernel has an i32
    try:
        assert dl.kernel_layout(kernel, 5) is None
    finally:
        kernel.src.signature = signature


def test_triton_s_cache_key_is_hashed_ahead_once_and_is_the_one_triton_computes():
    from triton.runtime.cache import triton_key

    from sgl_piecewise.backends.triton_kernels import launch

    launch.hash_triton_sources_ahead()
    ahead = launch._triton_key_ahead
    launch.hash_triton_sources_ahead()  # once per process
    assert launch._triton_key_ahead is ahead
    launch._wait_for_triton_key()
    assert ahead.done() and ahead.result() == triton_key()
