"""Where a step's time goes, for the benchmark suite: the CUDA kernels one
whole-model replay launches."""

from __future__ import annotations

from typing import Callable

import torch


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
