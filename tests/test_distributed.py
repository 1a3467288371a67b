"""``sgl_piecewise.distributed``: the tensor-parallel group, its collectives
as custom ops (values, out of place, traced without a graph break, fake
shapes), the symmetric-memory internal and its fallback, and ``launch``
(results in rank order; a failing rank ends every rank).

Two ranks on the CPU (gloo). Every spawned run costs seconds of start-up,
so one run checks every collective; the GPU test needs two CUDA devices.
"""

import atexit
import math
import multiprocessing
import os
import time

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from sgl_piecewise.distributed import (
    ONE_SHOT_MAX_BYTES,
    SAFE_ENV,
    SMALL_ALL_REDUCE_MAX_BYTES,
    LaunchTimeoutError,
    RankFailedError,
    TensorParallel,
    comm_ops,
    destroy_tensor_parallel,
    groups,
    init_tensor_parallel,
    launch,
    prepare_communication,
    registry,
    symmetric_buffer_bytes,
    tensor_parallel,
)
from sgl_piecewise.distributed.groups import set_safe_env
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError
from sgl_piecewise.graphs.capture import GraphCapture
from sgl_piecewise.internals import symm_mem

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_torchrun_env(monkeypatch):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    destroy_tensor_parallel()


# ---- run on each rank (module level: spawn pickles them by name) ------------------
def _rank_input(rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    """Small integers, distinct per rank: sums are exact in any dtype."""
    return (torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) % 7 + 10 * rank).to(dtype)


def _expected(shape, size, dtype=torch.float32):
    inputs = [_rank_input(r, shape, dtype) for r in range(size)]
    return inputs, torch.stack(inputs).sum(0)


def _tp_step(x: torch.Tensor, y: torch.Tensor):
    """The three collectives, one's output into another. No arithmetic
    around them: on the CPU that would cost Inductor a C++ compile (15 s)."""
    tp = tensor_parallel()
    a = tp.all_reduce(x)
    return a, tp.all_gather(a, dim=-1), tp.all_gather(x, dim=0), tp.reduce_scatter(y)


def _expected_step(rank: int, rows: int, size: int):
    xs, _ = _expected((rows, 3), size)
    ys, y_sum = _expected((2 * rows, 5), size)
    a = sum(xs)
    share = y_sum.chunk(size)[rank]
    return (a, torch.cat([a] * size, dim=-1), torch.cat(xs, dim=0), share), xs[rank], ys[rank]


def _check_step(step, rank: int, size: int) -> None:
    for rows in (4, 6):  # two token counts: one dynamic graph serves both
        want, x, y = _expected_step(rank, rows, size)
        x_before, y_before = x.clone(), y.clone()
        for got, expected in zip(step(x, y), want):
            torch.testing.assert_close(got, expected)
        assert torch.equal(x, x_before) and torch.equal(y, y_before)  # out of place


def _check_values(tp: TensorParallel) -> None:
    """Every collective against a local computation, inputs untouched."""
    for dtype in (torch.float32, torch.bfloat16):
        xs, total = _expected((5, 4), tp.size, dtype)
        x = xs[tp.rank]
        before = x.clone()
        out = tp.all_reduce(x)
        torch.testing.assert_close(out, total)
        assert out.data_ptr() != x.data_ptr() and torch.equal(x, before)
        torch.testing.assert_close(tp.all_gather(x, dim=0), torch.cat(xs, dim=0))
        torch.testing.assert_close(tp.all_gather(x, dim=-1), torch.cat(xs, dim=-1))
        torch.testing.assert_close(tp.all_gather(x, dim=1), torch.cat(xs, dim=1))
        ys, y_sum = _expected((4, 3), tp.size, dtype)
        torch.testing.assert_close(tp.reduce_scatter(ys[tp.rank]), y_sum.chunk(tp.size)[tp.rank])
        assert torch.equal(x, before)
    # A non-contiguous input, and a 3-d gather along the middle dimension.
    xs, total = _expected((3, 4), tp.size)
    torch.testing.assert_close(tp.all_reduce(xs[tp.rank].t()), total.t())
    cubes = [_rank_input(r, (2, 3, 2)) for r in range(tp.size)]
    torch.testing.assert_close(tp.all_gather(cubes[tp.rank], dim=1), torch.cat(cubes, dim=1))


def _check_refusals(tp: TensorParallel) -> None:
    """Bad arguments raise before any rank communicates, on every rank alike."""
    with pytest.raises(InvalidInputError, match="divisible by the group's size 2"):
        tp.reduce_scatter(torch.ones(3, 4))
    with pytest.raises(InvalidInputError, match="dim: expected a dimension"):
        tp.all_gather(torch.ones(3, 4), dim=2)
    with pytest.raises(InvalidInputError, match="world_size: expected the group's size 2, got 3"):
        torch.ops.sgl_piecewise.all_gather(torch.ones(2), 0, 3, tp.group_name)
    with pytest.raises(InvalidInputError, match="group_name: expected the name of a process group"):
        torch.ops.sgl_piecewise.all_reduce(torch.ones(2), "no such group")


def _check_compiled(tp: TensorParallel) -> None:
    """fullgraph=True, dynamic=True: the three ops trace as graph nodes with
    no break, one graph serves two token counts, and Inductor's code gives
    the same values. Rank 0 runs Inductor's code, rank 1 the traced graph
    as is (both issue the same collectives; one Inductor compile instead of
    two on a small CPU)."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    backend = "inductor" if tp.rank == 0 else counting
    _check_step(torch.compile(_tp_step, backend=backend, fullgraph=True, dynamic=True), tp.rank, tp.size)
    if tp.rank == 0:
        return
    assert len(graphs) == 1
    targets = {str(node.target).removesuffix(".default") for node in graphs[0].graph.nodes}
    assert {f"sgl_piecewise.{op}" for op in ("all_reduce", "all_gather", "reduce_scatter")} <= targets, targets


def _check_opcheck(tp: TensorParallel) -> None:
    x = _rank_input(tp.rank, (4, 3))
    torch.library.opcheck(torch.ops.sgl_piecewise.all_reduce.default, (x, tp.group_name))
    torch.library.opcheck(torch.ops.sgl_piecewise.all_gather.default, (x, -1, tp.size, tp.group_name))
    torch.library.opcheck(torch.ops.sgl_piecewise.reduce_scatter.default, (x, tp.size, tp.group_name))


def _check_without_symmetric_memory(tp: TensorParallel) -> None:
    """The internal forced off (as on a torch without it): prepare is a
    no-op, and all-reduces give the same sums (NCCL/gloo path)."""
    saved = symm_mem.AVAILABLE
    symm_mem.AVAILABLE = False
    try:
        prepare_communication(16, 4, torch.bfloat16, tp.device)
        assert symmetric_buffer_bytes() == 0
        xs, total = _expected((16, 4), tp.size, torch.bfloat16)
        torch.testing.assert_close(tp.all_reduce(xs[tp.rank]), total)
    finally:
        symm_mem.AVAILABLE = saved


def _check_everything_on_two_ranks():
    tp = tensor_parallel()
    assert (tp.size, tp.group_name != "", tp.device) == (2, True, torch.device("cpu"))
    assert tp.is_first == (tp.rank == 0)
    prepare_communication(16, 4, torch.bfloat16, "cpu")  # a no-op on the CPU
    assert symmetric_buffer_bytes() == 0
    _check_values(tp)
    _check_refusals(tp)
    _check_without_symmetric_memory(tp)
    _check_opcheck(tp)
    _check_compiled(tp)
    tp.barrier()
    env = {name: os.environ.get(name) for name in SAFE_ENV}
    return {"rank": tp.rank, "objects": tp.all_gather_object({"rank": tp.rank}), "env": env}


def _rank_1_raises_while_rank_0_waits_in_a_collective():
    tp = tensor_parallel()
    if tp.rank == 1:
        time.sleep(1.0)  # rank 0 is inside the barrier by then
        raise ValueError("boom")
    tp.barrier()  # a gloo collective: rank 0 waits here for a peer that is gone
    return tp.all_reduce(torch.ones(4))


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _mark_at_exit(folder: str) -> int:
    rank = tensor_parallel().rank
    atexit.register(lambda: open(os.path.join(folder, f"exited-{rank}"), "w").close())
    return rank


# ---- two ranks on the CPU --------------------------------------------------------
def test_every_collective_on_two_cpu_ranks_returns_in_rank_order():
    results = launch(_check_everything_on_two_ranks, 2, timeout_s=300)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["objects"] for r in results] == [[{"rank": 0}, {"rank": 1}]] * 2
    assert [r["env"] for r in results] == [SAFE_ENV] * 2  # multicast off in every rank


def test_the_safe_environment_overrides_values_that_would_allow_multicast_and_keeps_the_rest(caplog):
    # A mapping of its own, not this process's environment, and values that
    # differ from the safe ones without naming an enabling one: nothing here
    # may turn multicast on, even for a moment. Each value other, one missing.
    flipped = {name: f"not-{value}" for name, value in SAFE_ENV.items()}
    missing = next(iter(flipped))
    environ = {**{k: v for k, v in flipped.items() if k != missing}, "OTHER": "kept"}
    set_safe_env(environ)
    assert environ == {**SAFE_ENV, "OTHER": "kept"}
    assert all(f"{name}={flipped[name]} would allow NVLink multicast" in caplog.text
               for name in SAFE_ENV if name != missing)  # fmt: skip


def test_a_failing_rank_ends_every_rank_and_names_itself():
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 of 2 failed") as info:
        launch(_rank_1_raises_while_rank_0_waits_in_a_collective, 2, timeout_s=120)
    assert time.monotonic() - start < 60
    assert info.value.rank == 1 and "ValueError: boom" in info.value.cause
    assert "boom" in str(info.value)
    assert multiprocessing.active_children() == []


def test_a_run_past_its_timeout_ends_every_rank():
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError, match="expected the ranks to finish within 2 s"):
        launch(_sleep, 2, 120, timeout_s=2)
    assert time.monotonic() - start < 30
    assert multiprocessing.active_children() == []


def test_a_rank_done_runs_its_exit_handlers_before_it_ends(tmp_path):
    # It ends without the interpreter's finalisation (launch._exit_done), but
    # what a rank registered to run at exit still runs.
    assert launch(_mark_at_exit, 2, str(tmp_path), timeout_s=120) == [0, 1]
    assert sorted(os.listdir(tmp_path)) == ["exited-0", "exited-1"]


def test_launch_refuses_what_spawn_cannot_pickle_by_name():
    def local():
        return 1

    for fn in (local, lambda: 1):
        with pytest.raises(InvalidInputError, match="fn: expected a module-level function"):
            launch(fn, 2)
    with pytest.raises(InvalidInputError, match="nprocs: expected a positive int"):
        launch(_rank_1_raises_while_rank_0_waits_in_a_collective, 0)
    with pytest.raises(InvalidTypeError, match="sequence_parallel: expected a bool, got 'yes'"):
        launch(_sleep, 2, 0, sequence_parallel="yes")
    assert multiprocessing.active_children() == []  # refused before any rank started


# ---- one rank, in this process ---------------------------------------------------
def test_without_torchrun_s_environment_the_group_is_one_rank(no_torchrun_env):
    assert tensor_parallel() == TensorParallel(rank=0, size=1, group_name="")
    tp = init_tensor_parallel(device="cpu")
    assert (tp.rank, tp.size, tp.group_name, tp.device, tp.is_first) == (0, 1, "", torch.device("cpu"), True)
    assert tensor_parallel() is tp
    x = torch.randn(4, 6)
    assert tp.all_reduce(x) is x and tp.all_gather(x, dim=0) is x and tp.reduce_scatter(x) is x
    assert tp.all_gather_object({"a": 1}) == [{"a": 1}]
    tp.barrier()
    prepare_communication(8, 6, torch.bfloat16, "cpu")
    assert symmetric_buffer_bytes() == 0
    # Sequence parallelism needs several ranks: at one it changes nothing.
    assert not tp.splits_sequence and not init_tensor_parallel(device="cpu", sequence_parallel=True).splits_sequence
    with pytest.raises(InvalidTypeError, match="sequence_parallel: expected a bool, got 1"):
        init_tensor_parallel(device="cpu", sequence_parallel=1)
    destroy_tensor_parallel()
    assert tensor_parallel().device is None


def test_a_bad_environment_is_refused_before_any_process_group(no_torchrun_env):
    no_torchrun_env.setenv("WORLD_SIZE", "two")
    with pytest.raises(InvalidInputError, match="WORLD_SIZE: expected an int in the environment, got 'two'"):
        init_tensor_parallel(device="cpu")
    no_torchrun_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(InvalidInputError, match="RANK: expected it set in the environment"):
        init_tensor_parallel(device="cpu")
    no_torchrun_env.setenv("RANK", "2")
    with pytest.raises(InvalidInputError, match="RANK: expected 0 <= RANK < WORLD_SIZE=2, got 2"):
        init_tensor_parallel(device="cpu")
    no_torchrun_env.setenv("RANK", "0")
    with pytest.raises(InvalidInputError, match="MASTER_ADDR: expected it set"):
        init_tensor_parallel(device="cpu")
    with pytest.raises(InvalidInputError, match="timeout_s: expected a finite number"):
        init_tensor_parallel(device="cpu", timeout_s=0)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    no_torchrun_env.setenv("WORLD_SIZE", str(visible + 1))
    with pytest.raises(InvalidInputError, match=f"WORLD_SIZE: expected at most the {visible} visible GPUs"):
        init_tensor_parallel(device="cuda")
    assert tensor_parallel().size == 1


def test_prepare_communication_checks_its_arguments():
    with pytest.raises(InvalidInputError, match="max_tokens: expected a positive int"):
        prepare_communication(0, 8, torch.bfloat16, "cpu")
    with pytest.raises(InvalidTypeError, match="dtype: expected a torch.dtype"):
        prepare_communication(8, 8, "bf16", "cpu")


def test_the_fake_implementations_give_the_shapes_and_refuse_what_the_real_ones_do():
    with FakeTensorMode():
        x = torch.empty(6, 4, dtype=torch.bfloat16)
        ops = torch.ops.sgl_piecewise
        assert ops.all_reduce(x, "any").shape == (6, 4)
        assert ops.all_gather(x, 0, 2, "any").shape == (12, 4)
        assert ops.all_gather(x, -1, 2, "any").shape == (6, 8)
        assert ops.reduce_scatter(x, 3, "any").shape == (2, 4)
        assert ops.reduce_scatter(x, 2, "any").dtype == torch.bfloat16
        with pytest.raises(InvalidInputError, match="expected dim 0 divisible by the group's size 4"):
            ops.reduce_scatter(x, 4, "any")
        with pytest.raises(InvalidInputError, match="dim: expected a dimension"):
            ops.all_gather(x, -3, 2, "any")
        with pytest.raises(InvalidInputError, match="world_size: expected a positive int"):
            ops.all_gather(x, 0, 0, "any")


# ---- the symmetric-memory internal -----------------------------------------------
def test_the_symmetric_memory_internal_reports_itself_on_the_installed_torch():
    assert symm_mem.TORCH_VERSIONS == ("2.11", "2.13")
    assert symm_mem.__doc__ and "2.11-2.13" in symm_mem.__doc__
    if torch.backends.cuda.is_built():
        assert symm_mem.AVAILABLE, symm_mem.UNAVAILABLE_REASON
        return
    assert not symm_mem.AVAILABLE
    assert "without CUDA" in symm_mem.UNAVAILABLE_REASON


def test_small_all_reduces_take_symmetric_memory_only_where_it_can_serve_them(monkeypatch):
    """The choice of path, on meta tensors standing for a device's."""
    monkeypatch.setattr(symm_mem, "AVAILABLE", True)
    monkeypatch.setattr(symm_mem, "TWO_SHOT", True)
    name = "test-group"
    assert not comm_ops.uses_symmetric_memory(torch.empty(8, device="meta"), name)  # no buffer
    registry.add_buffer(name, torch.empty(SMALL_ALL_REDUCE_MAX_BYTES, dtype=torch.uint8, device="meta"))

    def path(nbytes: int, dtype=torch.bfloat16, device="meta"):
        return comm_ops.symmetric_path(torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=device), name)

    try:
        small = torch.empty(64, 896, dtype=torch.bfloat16, device="meta")
        assert comm_ops.uses_symmetric_memory(small, name)
        assert comm_ops.uses_symmetric_memory(small.float(), name)
        assert not comm_ops.uses_symmetric_memory(small.half(), name)  # the ops take bf16 and fp32 only
        assert not comm_ops.uses_symmetric_memory(torch.empty(3, dtype=torch.bfloat16, device="meta"), name)  # 6 bytes
        assert not comm_ops.uses_symmetric_memory(
            torch.empty(64, 896, dtype=torch.bfloat16), name
        )  # not the buffer's device
        # One-shot up to ONE_SHOT_MAX_BYTES, two-shot above it, NCCL above the buffer.
        assert [path(n) for n in (4, ONE_SHOT_MAX_BYTES)] == ["one_shot"] * 2
        assert [path(n) for n in (ONE_SHOT_MAX_BYTES + 4, SMALL_ALL_REDUCE_MAX_BYTES)] == ["two_shot"] * 2
        assert path(SMALL_ALL_REDUCE_MAX_BYTES, torch.float32) == "two_shot"
        assert path(SMALL_ALL_REDUCE_MAX_BYTES + 4) is None
        # The buffer holds the largest symmetric message, rounded up to 16 bytes.
        assert (groups._buffer_bytes(10**9), groups._buffer_bytes(1000)) == (SMALL_ALL_REDUCE_MAX_BYTES, 1008)
        monkeypatch.setattr(symm_mem, "TWO_SHOT", False)  # a torch without the op: one-shot takes it all
        assert path(SMALL_ALL_REDUCE_MAX_BYTES) == "one_shot"
        monkeypatch.setattr(symm_mem, "AVAILABLE", False)
        assert not comm_ops.uses_symmetric_memory(small, name)
    finally:
        registry.forget_group(name)


# ---- two GPUs --------------------------------------------------------------------
def _all_reduce_in_graphs_on_cuda():
    """bf16 all-reduce through symmetric memory and through NCCL: eager, and
    captured in a CUDA graph replayed twice with new inputs."""
    tp = tensor_parallel()
    rows, hidden = 4, 896
    prepare_communication(rows, hidden, torch.bfloat16, tp.device)
    assert symmetric_buffer_bytes() >= rows * hidden * 2
    used = []
    assert symm_mem.COPY_IN_KERNEL  # torch 2.11+ on CUDA: the op that copies in its kernel
    # Symmetric memory with the copy in the op's kernel, then the copy and
    # the plain op (the fallback), then NCCL.
    for via_symm_mem, copy_in_kernel in ((True, True), (True, False), (False, False)):
        symm_mem.AVAILABLE = via_symm_mem and symm_mem.UNAVAILABLE_REASON == ""
        symm_mem.COPY_IN_KERNEL = copy_in_kernel
        xs, total = _expected((rows, hidden), tp.size, torch.bfloat16)
        assert comm_ops.uses_symmetric_memory(xs[tp.rank].to(tp.device), tp.group_name) == via_symm_mem
        _sums_right_eagerly_and_in_a_graph(tp, xs, total)
        large = torch.ones(SMALL_ALL_REDUCE_MAX_BYTES // 2 + 2, dtype=torch.bfloat16, device=tp.device)
        assert not comm_ops.uses_symmetric_memory(large, tp.group_name)
        torch.testing.assert_close(tp.all_reduce(large), large * tp.size)
        used.append((via_symm_mem, copy_in_kernel))
    return used


def _two_shot_in_graphs_on_cuda():
    """Messages above ONE_SHOT_MAX_BYTES: the two-shot op, eager and in a
    CUDA graph replayed with new inputs, bf16 and fp32; the one-shot op
    where torch lacked the two-shot one: the same sums."""
    tp = tensor_parallel()
    hidden = 1024
    prepare_communication(SMALL_ALL_REDUCE_MAX_BYTES // (hidden * 2), hidden, torch.bfloat16, tp.device)
    assert symmetric_buffer_bytes() == SMALL_ALL_REDUCE_MAX_BYTES
    taken = []
    for dtype, two_shot in ((torch.bfloat16, True), (torch.float32, True), (torch.bfloat16, False)):
        symm_mem.TWO_SHOT = two_shot
        rows = (ONE_SHOT_MAX_BYTES + SMALL_ALL_REDUCE_MAX_BYTES) // 2 // (hidden * dtype.itemsize)
        xs, total = _expected((rows, hidden), tp.size, dtype)
        taken.append(comm_ops.symmetric_path(xs[tp.rank].to(tp.device), tp.group_name))
        _sums_right_eagerly_and_in_a_graph(tp, xs, total)
    return taken


def _sums_right_eagerly_and_in_a_graph(tp, xs, total) -> None:
    """``tp.all_reduce`` of this rank's ``xs`` gives ``total`` eagerly, then
    captured in a CUDA graph (warmed up on a side stream) replayed twice
    with new inputs."""
    static = xs[tp.rank].to(tp.device)
    torch.testing.assert_close(tp.all_reduce(static).cpu(), total)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tp.all_reduce(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tp.all_reduce(static)
    for step in (1, 2):
        shifted = [t + step for t in xs]
        static.copy_(shifted[tp.rank].to(tp.device))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.cpu(), torch.stack(shifted).sum(0))


@pytest.mark.gpu
def test_gpu_larger_messages_take_the_two_shot_op_and_sum_right_in_cuda_graphs():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, got {torch.cuda.device_count()}")
    assert symm_mem.TWO_SHOT  # torch 2.11+ on CUDA
    taken = launch(_two_shot_in_graphs_on_cuda, 2, device="cuda", timeout_s=300)
    assert taken == [["two_shot", "two_shot", "one_shot"]] * 2


@pytest.mark.gpu
def test_gpu_all_reduce_through_symmetric_memory_and_nccl_in_cuda_graphs():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, got {torch.cuda.device_count()}")
    assert symm_mem.AVAILABLE, symm_mem.UNAVAILABLE_REASON
    used = [(True, True), (True, False), (False, False)]
    assert launch(_all_reduce_in_graphs_on_cuda, 2, device="cuda", timeout_s=300) == [used] * 2


# Graphs that outlive the function that captured them, as a compiled
# function's cache keeps its graphs for the life of the process.
_KEPT_GRAPHS: list = []


def _keep_a_graph_of_an_nccl_gather_then_destroy_the_group() -> bool:
    tp = tensor_parallel()
    x = torch.full((2, 8), float(tp.rank), device=tp.device)
    capture = GraphCapture(tp.device)
    capture.warmup(lambda: tp.all_gather(x, dim=0))
    graph, out = capture.record(lambda: tp.all_gather(x, dim=0), "an all-gather")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.arange(tp.size).repeat_interleave(2)[:, None].float().expand(-1, 8))
    _KEPT_GRAPHS.append(graph)
    destroy_tensor_parallel()  # returns: the graph is reset first, not waited for
    with pytest.raises(RuntimeError):
        graph.replay()
    return True


@pytest.mark.gpu
def test_gpu_a_live_graph_holding_nccl_kernels_does_not_hang_the_groups_teardown():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, got {torch.cuda.device_count()}")
    assert launch(_keep_a_graph_of_an_nccl_gather_then_destroy_the_group, 2, device="cuda", timeout_s=120) == [True] * 2
