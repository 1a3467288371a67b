"""The capture core: pool, capture stream, warm-up, largest-first order."""

import pytest
import torch

from sgl_piecewise.errors import UnsupportedModeError
from sgl_piecewise.graphs.capture import GraphCapture, explain_capture_failure


def test_without_cuda_a_recording_runs_the_function_once_and_keeps_no_graph():
    core = GraphCapture("cpu")
    calls = []
    graph, out = core.record(lambda: calls.append(1) or torch.ones(2))
    assert graph is None and calls == [1]
    torch.testing.assert_close(out, torch.ones(2))
    assert list(core.largest_first([2, 8, 4], "sizes", "size", progress=False)) == [8, 4, 2]
    assert core.pool_bytes() == 0


def test_a_refused_sync_is_explained_with_its_cause():
    refused = RuntimeError("called a synchronizing CUDA operation")
    assert "never waits for the device" in str(explain_capture_failure(refused, "decode graph of bs 4"))
    assert explain_capture_failure(RuntimeError("out of memory"), "x") is None


def _reserved_outside(core: GraphCapture) -> int:
    return torch.cuda.memory_reserved() - core.pool_bytes()


@pytest.mark.gpu
def test_gpu_a_capture_phase_leaves_no_warmup_scratch_cached_and_its_graphs_still_replay():
    """Each warm-up frees a 64 MiB product on the capture stream, where the
    allocator would keep it for that stream alone; the phase gives it back,
    and the graphs (whose memory is the pool's) still replay right."""
    core = GraphCapture("cuda")
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = _reserved_outside(core)
    recorded = {}
    for size in core.largest_first([2, 1], "sizes", "size", progress=False):
        step = lambda size=size: (x[: 2048 * size] @ x).relu()  # noqa: E731
        core.warmup(step)
        recorded[size] = core.record(step)
    assert _reserved_outside(core) <= before
    for size, (graph, out) in recorded.items():
        out.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(out, (x[: 2048 * size] @ x).relu())


@pytest.mark.gpu
def test_gpu_a_forward_that_reads_the_device_is_refused_and_leaves_the_process_capturing():
    """``.item()`` inside a capture raises before it reaches CUDA, so the
    capture ends cleanly: the pool takes the next capture and the random
    generator works (after a capture CUDA invalidates, torch leaves both in
    capture state: "already recording to mempool_id", "Offset increment
    outside graph capture")."""
    core = GraphCapture("cuda")
    x = torch.ones(4, device="cuda")
    with pytest.raises(UnsupportedModeError, match="tiny graph: expected a forward that never waits for the device"):
        core.record(lambda: (x * 2).sum().item(), "tiny graph")
    assert torch.cuda.get_sync_debug_mode() == 0
    graph, out = core.record(lambda: x * 3)
    graph.replay()
    assert out.tolist() == [3.0] * 4
    assert torch.randn(3, device="cuda").shape == (3,)


@pytest.mark.gpu
def test_gpu_after_a_capture_cuda_invalidated_later_captures_go_to_a_new_pool():
    """A sync torch's check does not see (here: the check switched off inside
    the forward) invalidates the capture; CUDA refuses to end it, and the
    core captures into a fresh pool from then on."""
    core = GraphCapture("cuda")
    x = torch.ones(4, device="cuda")
    old_pool = core.pool

    def unchecked_sync():
        torch.cuda.set_sync_debug_mode("default")
        return (x * 2).sum().item()

    with pytest.raises(RuntimeError):
        core.record(unchecked_sync)
    assert core.pool != old_pool
    graph, out = core.record(lambda: x * 3)
    graph.replay()
    assert out.tolist() == [3.0] * 4
    # The new pool's first (clean) capture took the generator out of capture state.
    assert torch.randn(3, device="cuda").shape == (3,)
