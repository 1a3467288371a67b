"""The capture core: pool, capture stream, warm-up, largest-first order."""

import pytest
import torch

from sgl_piecewise.runners.capture import GraphCapture


def test_without_cuda_a_recording_runs_the_function_once_and_keeps_no_graph():
    core = GraphCapture("cpu")
    calls = []
    graph, out = core.record(lambda: calls.append(1) or torch.ones(2))
    assert graph is None and calls == [1]
    torch.testing.assert_close(out, torch.ones(2))
    assert list(core.largest_first([2, 8, 4], "sizes", "size", progress=False)) == [8, 4, 2]


def _reserved_outside(pool) -> int:
    segments = torch.cuda.memory._snapshot()["segments"]
    in_pool = sum(s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) == tuple(pool))
    return torch.cuda.memory_reserved() - in_pool


@pytest.mark.gpu
def test_gpu_a_capture_phase_leaves_no_warmup_scratch_cached_and_its_graphs_still_replay():
    """Each warm-up frees a 64 MiB product on the capture stream, where the
    allocator would keep it for that stream alone; the phase gives it back,
    and the graphs (whose memory is the pool's) still replay right."""
    core = GraphCapture("cuda")
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = _reserved_outside(core.pool)
    recorded = {}
    for size in core.largest_first([2, 1], "sizes", "size", progress=False):
        step = lambda size=size: (x[: 2048 * size] @ x).relu()  # noqa: E731
        core.warmup(step)
        recorded[size] = core.record(step)
    assert _reserved_outside(core.pool) <= before
    for size, (graph, out) in recorded.items():
        out.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(out, (x[: 2048 * size] @ x).relu())


@pytest.mark.gpu
def test_gpu_a_capture_cuda_invalidated_leaves_the_pool_able_to_capture_again():
    """``.item()`` waits for the device, which invalidates the capture; CUDA
    then refuses to end it, and the pool must still take the next capture
    (it used to answer "already recording to mempool_id" for the rest of
    the process)."""
    core = GraphCapture("cuda")
    x = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError):
        core.record(lambda: (x * 2).sum().item())
    graph, out = core.record(lambda: x * 3)
    graph.replay()
    assert out.tolist() == [3.0] * 4
