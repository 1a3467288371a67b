"""Where a step's time goes, for the benchmark scripts: the CUDA kernels one
whole-model replay launches, by class, and the device's idle time between
them."""

from __future__ import annotations

from typing import Callable, List

import torch

# Kernel name fragments (lower case) of each class, first match wins; the
# rest is "other": Inductor's kernels, copies of torch's.
COMM_KERNEL_MARKS = ("allreduce", "all_reduce", "nccl", "one_shot")
KERNEL_CLASSES = (
    ("collective", COMM_KERNEL_MARKS),
    ("projection", ("_linear_kernel", "_paired_kernel")),
    ("matmul", ("nvjet", "gemm", "cutlass", "splitkreduce", "xmma")),
    ("attention", ("decode", "extend", "attn", "store_kv")),
    ("norm", ("rms_norm", "rmsnorm")),
    ("rotary", ("rotary",)),
    ("activation", ("silu",)),
    ("embedding", ("embedding", "indexselect", "index_select")),
)


def kernel_class(name: str) -> str:
    """The class of the kernel ``name`` (``KERNEL_CLASSES``), or ``"other"``."""
    lower = name.lower()
    return next((kind for kind, marks in KERNEL_CLASSES if any(mark in lower for mark in marks)), "other")


def kernels_per_replay(replay: Callable[[], object]) -> int:
    """CUDA kernels one call of ``replay`` runs (copies and fills excluded)."""
    return replay_profile(replay)["kernels"]


def replay_profile(replay: Callable[[], object], top: int = 12) -> dict:
    """One call of ``replay`` through torch.profiler, which lists a replayed
    graph's kernels one by one: the kernels (copies and fills excluded), their
    µs by class (and each class's own µs, no earlier kernel running), the
    ``top`` longest, the kernels' summed µs, the span from the first start to
    the last end and the µs of it that no kernel covers."""
    from torch.profiler import ProfilerActivity, profile

    replay()  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    events = [e for e in prof.events() if e.device_type == cuda]
    kernels = [e for e in events if not _is_copy_or_fill(e.name)]
    by_class, by_name, own_by_class = {}, {}, {}
    reach = float("-inf")  # the latest end of the kernels before
    for e in sorted(kernels, key=lambda e: e.time_range.start):
        us = e.time_range.elapsed_us()
        kind = kernel_class(e.name)
        by_class[kind] = by_class.get(kind, 0.0) + us
        by_name[e.name[:100]] = by_name.get(e.name[:100], 0.0) + us
        # Under PDL a kernel starts while the one before runs: its own share
        # is the part of its run no earlier kernel covers.
        start, end = e.time_range.start, e.time_range.end
        own_by_class[kind] = own_by_class.get(kind, 0.0) + max(end - max(start, reach), 0.0)
        reach = max(reach, end)
    spans = [(e.time_range.start, e.time_range.end) for e in events]
    return {"kernels": len(kernels), "kernel_us": sum(by_class.values()), "us_by_class": by_class,
            "own_us_by_class": own_by_class,
            "top_kernels_us": dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:top]),
            "span_us": max(end for _, end in spans) - min(start for start, _ in spans) if spans else 0.0,
            "idle_us": idle_us(spans)}  # fmt: skip


def idle_us(spans: List[tuple]) -> float:
    """Time between the first start and the last end of ``spans`` (``(start,
    end)`` in µs) that none of them covers."""
    idle, reach = 0.0, None
    for start, end in sorted(spans):
        if reach is not None and start > reach:
            idle += start - reach
        reach = end if reach is None else max(reach, end)
    return idle


def _is_copy_or_fill(name: str) -> bool:
    name = name.lower()
    return name.startswith("memcpy") or name.startswith("memset")
