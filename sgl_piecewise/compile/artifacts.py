"""Inductor's compile artifacts saved in ``CompileOptions.cache_dir`` for later
processes. The key covers the graph, the options, the library's, torch's and
Triton's versions, the device and the tensor-parallel rank: a changed model
or setup finds no file and compiles afresh.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from typing import Any, Sequence

import torch
import torch.fx

from sgl_piecewise.compile import piece_compiler
from sgl_piecewise.distributed import tensor_parallel
from sgl_piecewise.graphs.counters import counters
from sgl_piecewise.version import __version__

logger = logging.getLogger("sgl_piecewise.compile")


def artifact_key(structural_key: str, options: Any, device: torch.device) -> str:
    parts = [
        structural_key,
        repr(options),
        __version__,
        torch.__version__,
        triton_version(),
        device_id(device),
        tensor_parallel_id(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "no triton"
    return triton.__version__


def tensor_parallel_id() -> str:
    """Each rank saves and loads its own compile: its graphs hold its share of every shape."""
    tp = tensor_parallel()
    return f"tensor parallel rank {tp.rank} of {tp.size}"


def device_id(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    props = torch.cuda.get_device_properties(device)
    return f"{props.name} sm_{props.major}{props.minor}"


def artifact_path(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, f"{key}.bin")


def load_artifacts(cache_dir: str, key: str) -> bool:
    """Load the artifacts saved under ``key``; False when there are none."""
    path = artifact_path(cache_dir, key)
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        data = f.read()
    try:
        torch.compiler.load_cache_artifacts(data)
    except Exception as exc:  # a damaged file costs a compile, never a failure
        logger.warning("compile artifacts %s: expected a readable file, got %s; compiling afresh", path, exc)
        return False
    counters.artifacts_loaded += 1
    return True


def save_artifacts(cache_dir: str, key: str) -> bool:
    """Save this process's compile artifacts under ``key``."""
    saved = torch.compiler.save_cache_artifacts()
    if not saved:
        return False
    write_atomically(artifact_path(cache_dir, key), saved[0])
    counters.artifacts_saved += 1
    return True


def write_atomically(path: str, data: bytes) -> None:
    """Write ``path`` (its directory made if missing) so that a concurrent
    reader sees the old file or the new one, never half of one."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def graph_key(gm: torch.fx.GraphModule, fake_inputs: Sequence[Any]) -> str:
    return piece_compiler.structural_key(gm, fake_inputs)
