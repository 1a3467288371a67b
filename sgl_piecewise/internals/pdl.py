"""Programmatic dependent launch (PDL) for the library's Triton kernels.

A kernel launched with PDL (Triton's launch option ``launch_pdl=True``) may
be scheduled while the kernel before it on the stream is still running; it
calls ``gdc_wait()`` before it touches anything that kernel writes or reads,
and ``gdc_launch_dependents()`` to let the next one be scheduled early. In a
CUDA graph the launches become programmatic edges, so a chain of such
kernels runs without the drain and launch gap between kernels. A kernel
launched without PDL is a full barrier: the chain breaks there, but nothing
goes wrong.

Written against Triton 3.4-3.6 (the launch option and the two functions of
``triton.language.extra.cuda``, public but undocumented); Hopper (sm_90) or
newer. :data:`AVAILABLE` is False, with :data:`UNAVAILABLE_REASON`, where the
installed Triton lacks them; :func:`enabled` then answers False and kernels
launch without PDL. ``SGL_PIECEWISE_PDL=0`` turns it off as well.
"""

from __future__ import annotations

import functools
import os

import torch

TRITON_VERSIONS = ("3.4", "3.6")
ENV_SWITCH = "SGL_PIECEWISE_PDL"


def _find() -> tuple:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda
    except ImportError as exc:
        return None, None, f"Triton's CUDA backend does not import ({exc})"
    wait, launch = getattr(cuda, "gdc_wait", None), getattr(cuda, "gdc_launch_dependents", None)
    if wait is None or launch is None:
        return None, None, "triton.language.extra.cuda has no gdc_wait / gdc_launch_dependents"
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return None, None, "Triton's CUDA options have no launch_pdl"
    return wait, launch, ""


gdc_wait, gdc_launch_dependents, UNAVAILABLE_REASON = _find()
AVAILABLE: bool = gdc_wait is not None


@functools.lru_cache(maxsize=16)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: Triton has it, the
    device is a CUDA one of compute capability 9.0 or newer, and the
    environment does not turn it off."""
    if not AVAILABLE or device.type != "cuda" or os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())
