"""Where a step's time goes, for the benchmark suite: kernels launched by one
whole-model replay, and the host time of the attention between pieces."""

from __future__ import annotations

import time
from typing import Callable, List

import torch

import sgl_piecewise as sp


def kernels_per_replay(replay: Callable[[], object]) -> int:
    """CUDA kernels one call of ``replay`` runs (copies and fills excluded),
    counted by torch.profiler, which lists a replayed graph's kernels one by one."""
    from torch.profiler import ProfilerActivity, profile

    replay()  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return sum(1 for e in prof.events() if e.device_type == cuda and not _is_copy_or_fill(e.name))


def _is_copy_or_fill(name: str) -> bool:
    name = name.lower()
    return name.startswith("memcpy") or name.startswith("memset")


class _HostTimer:
    """Wraps one attention piece of a split graph; adds up its host time."""

    def __init__(self, piece, seconds: List[float]):
        self.piece, self.seconds = piece, seconds

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.piece(*args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - start)


def hop_host_us_per_layer(compiled, runner, batch, steps: int = 20) -> float:
    """Median host time of one attention call between compiled pieces (µs),
    over ``steps`` piecewise steps of ``batch``: the kernels are launched, not
    waited for, so this is the Python and launch cost of the hop."""
    modules = [m for m in compiled.piecewise_modules if m.pieces]
    if not modules:
        return float("nan")
    seconds: List[float] = []
    originals = []
    for module in modules:
        for item in module.pieces:
            if item.is_splitting_op:
                piece = module.split_gm.__dict__.get(item.name) or getattr(module.split_gm, item.name)
                originals.append((module, item.name, piece))
                module.split_gm.__dict__[item.name] = _HostTimer(piece, seconds)
    try:
        with torch.no_grad():
            for _ in range(steps):
                runner.backend.init_forward_metadata(batch)
                with sp.forward_context(batch, runner.backend):
                    compiled(batch.input_ids, batch.positions)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        for module, name, piece in originals:
            module.split_gm.__dict__.pop(name, None)
            if getattr(module.split_gm, name, None) is not piece:
                module.split_gm.__dict__[name] = piece
    seconds.sort()
    return 1e6 * seconds[len(seconds) // 2] if seconds else float("nan")
