"""A model's distinct Inductor pieces wait for their kernels after the last
piece's lowering (``compile/kernel_waits.py``), not each at the end of its
own compile; saved compiles keep waiting per piece."""

import threading
from concurrent.futures import Future
from unittest import mock

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.async_compile import AsyncCompile

import sgl_piecewise as sp
from sgl_piecewise.backends import ReferenceBackend
from sgl_piecewise.compile import CompiledModel, CompileOptions, counters
from sgl_piecewise.compile import backend as compile_backend
from sgl_piecewise.compile.kernel_waits import deferred_kernel_waits
from sgl_piecewise.engine.testing import random_batch, two_layer_llama_config
from sgl_piecewise.models import build_random_model

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _started(value=None, error=None) -> Future:
    """A future as Inductor's workers hand back: done with ``value`` or ``error``."""
    future = Future()
    future.set_exception(error) if error is not None else future.set_result(value)
    return future


def _forget_inductor_modules() -> None:
    """Inductor's in-process caches (compiled modules, kernels) cleared."""
    from torch._inductor import utils

    (getattr(utils, "clear_caches", None) or utils.clear_inductor_caches)()


def _wait(scope: dict) -> None:
    """What a loading compiled module does: wait for the kernels in its globals."""
    AsyncCompile()._wait_futures(scope)


def test_a_wait_inside_is_done_at_the_exit():
    scope = {"kernel": _started("compiled kernel"), "other": 3}
    with deferred_kernel_waits():
        _wait(scope)
        assert isinstance(scope["kernel"], Future)  # noted, not done
    assert scope == {"kernel": "compiled kernel", "other": 3}


def test_a_wait_outside_or_on_another_thread_is_done_at_once():
    here, there = {"kernel": _started("a")}, {"kernel": _started("b")}
    _wait(here)
    assert here == {"kernel": "a"}
    with deferred_kernel_waits():
        worker = threading.Thread(target=_wait, args=(there,))
        worker.start()
        worker.join()
        assert there == {"kernel": "b"}


def test_a_nested_use_joins_the_outer_one():
    scope = {"kernel": _started("k")}
    with deferred_kernel_waits():
        with deferred_kernel_waits():
            _wait(scope)
        assert isinstance(scope["kernel"], Future)
    assert scope == {"kernel": "k"}


def test_two_threads_inside_each_wait_at_their_own_exit():
    original = AsyncCompile._wait_futures
    mine, theirs = {"kernel": _started("a")}, {"kernel": _started("b")}
    inside, leave = threading.Event(), threading.Event()

    def other_thread():
        with deferred_kernel_waits():
            _wait(theirs)
            inside.set()
            leave.wait(timeout=30)

    worker = threading.Thread(target=other_thread)
    with deferred_kernel_waits():
        worker.start()
        assert inside.wait(timeout=30)
        _wait(mine)
    assert mine == {"kernel": "a"}  # this thread's exit: its own wait only
    assert isinstance(theirs["kernel"], Future)
    _wait(scope := {"kernel": _started("c")})  # outside, while the other is still inside: at once
    assert scope == {"kernel": "c"}
    leave.set()
    worker.join()
    assert theirs == {"kernel": "b"}
    assert AsyncCompile._wait_futures is original  # Inductor's own, once the last thread is out


def test_a_kernel_that_failed_to_compile_raises_at_the_exit():
    scope = {"kernel": _started(error=RuntimeError("ptxas: out of registers"))}
    with pytest.raises(RuntimeError, match="out of registers"):
        with deferred_kernel_waits():
            _wait(scope)


def test_an_error_inside_waits_for_nothing_and_puts_inductor_back():
    original = AsyncCompile._wait_futures
    scope = {"kernel": _started("k")}
    with pytest.raises(ValueError, match="lowering failed"):
        with deferred_kernel_waits():
            _wait(scope)
            raise ValueError("lowering failed")
    assert isinstance(scope["kernel"], Future)
    assert AsyncCompile._wait_futures is original
    _wait(scope)  # and Inductor waits at once again
    assert scope == {"kernel": "k"}


@pytest.mark.parametrize("setting", ["cpp_wrapper", "triton.autotune_at_compile_time"])
def test_nothing_is_deferred_where_inductor_runs_kernels_while_compiling(setting):
    scope = {"kernel": _started("k")}
    with inductor_config.patch({setting: True}), deferred_kernel_waits():
        _wait(scope)
        assert scope == {"kernel": "k"}


@pytest.mark.parametrize(
    "options, defers",
    [
        (CompileOptions(), True),
        (CompileOptions(piece_compiler="eager"), False),
        (CompileOptions(cache_dir="compiles"), False),  # saved entries must bundle every kernel
    ],
)
def test_which_compiles_defer_their_waits(options, defers):
    with compile_backend._kernel_waits(options):
        scope = {"kernel": _started("k")}
        _wait(scope)
        assert isinstance(scope["kernel"], Future) == defers
    assert scope == {"kernel": "k"}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_inductor_pieces_wait_for_their_kernels_after_the_last_lowering(device):
    """A real Inductor compile of a two-layer model, its kernels (C++ on the
    CPU, Triton on CUDA) built by two compile workers: every piece's wait
    comes after the last piece compiled (on the CPU, each one for kernels
    still in its module's globals), and the compiled model then computes
    what the eager one does."""
    model = build_random_model(two_layer_llama_config(), device=device, seed=1)
    pool = sp.KVPool(512, 2, 2, 16, device=device)
    backend = ReferenceBackend(sp.ReqToTokenPool(max_reqs=8, max_context_len=64, device=device), pool)
    compiled = CompiledModel(model, CompileOptions(piece_compiler="inductor"))
    batch = random_batch(sp.ForwardMode.EXTEND, backend.req_to_token_pool, pool, [0], [5], vocab_size=256)
    backend.init_forward_metadata(batch)
    waits = []  # per wait done: (pieces compiled by then, started kernels it waited for)
    wait_now = AsyncCompile._wait_futures

    def recorded(self, scope):
        started = sum(isinstance(v, Future) or type(v).__name__.endswith("Future") for v in scope.values())
        waits.append((counters.pieces_compiled, started))
        wait_now(self, scope)

    counters.reset()
    _forget_inductor_modules()  # an earlier test's modules would load without waiting
    with (
        # Nor load from another process's caches; (mock.patch would delete
        # Inductor's settings on the way out: they are no module attributes.)
        inductor_config.patch(force_disable_caches=True, compile_threads=2),
        mock.patch.object(AsyncCompile, "_wait_futures", recorded),
        torch.no_grad(),
        sp.forward_context(batch, backend),
    ):
        out = compiled(batch.input_ids, batch.positions)
        expected = model(batch.input_ids, batch.positions)
    assert counters.pieces_compiled == 3  # first layer's head, the middle piece, the tail
    assert counters.kernel_waits_deferred == 3
    assert [pieces for pieces, _ in waits] == [3, 3, 3]
    if device == "cpu":
        # C++ kernels always go to the workers. Triton kernels compile in the
        # calling process until Inductor's worker pool is up, so a CUDA wait
        # may find nothing left to wait for.
        assert all(started > 0 for _, started in waits)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
