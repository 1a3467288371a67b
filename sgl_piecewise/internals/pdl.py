"""Programmatic dependent launch for the Triton kernels (Triton 3.4-3.6's
``launch_pdl`` and ``triton.language.extra.cuda``, undocumented; sm_90+): a
kernel may start while the one before it runs, closing the gap between
kernels in a graph. Fallback (or ``SGL_PIECEWISE_PDL=0``): no PDL.
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
    """Whether kernels on ``device`` launch with PDL."""
    if not AVAILABLE or device.type != "cuda" or os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())
