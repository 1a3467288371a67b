"""The tensor-parallel group: its ranks, process groups and collectives.
:func:`tensor_parallel` is a single rank where none was built, so a model
written for tensor parallelism runs unchanged on one device (each
collective then returns its input). The device group (NCCL, gloo on the CPU)
runs the forward's collectives; a gloo group runs host-side barriers.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, List, MutableMapping, Optional, Union

import torch
import torch.distributed as dist

from sgl_piecewise.checks import check_positive_int, same_device
from sgl_piecewise.distributed import comm_ops, fused_norm, registry
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError
from sgl_piecewise.internals import symm_mem

logger = logging.getLogger("sgl_piecewise.distributed")

# Never NVLink multicast (NVLS): set before NCCL or symmetric memory starts.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def set_safe_env(environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Set :data:`SAFE_ENV` in ``environ`` (the process's by default), whatever it held."""
    environ = os.environ if environ is None else environ
    for name, value in SAFE_ENV.items():
        held = environ.get(name)
        if held is not None and held != value:
            logger.warning("tensor parallel: %s=%s would allow NVLink multicast; set to %s", name, held, value)
        environ[name] = value


@dataclass(frozen=True)
class TensorParallel:
    """One rank's view of its group: ``group_name`` is what the ops take ("" at
    one rank); ``sequence_parallel`` splits the models' residual stream by tokens."""

    rank: int
    size: int
    group_name: str
    device: Optional[torch.device] = None
    device_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    cpu_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    sequence_parallel: bool = False

    def __deepcopy__(self, memo: dict) -> "TensorParallel":
        """The group itself (a model's copy has the same ranks)."""
        return self

    @property
    def splits_sequence(self) -> bool:
        return self.size > 1 and self.sequence_parallel

    @property
    def is_first(self) -> bool:
        """Rank 0: the rank that prints."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        return torch.ops.sgl_piecewise.all_reduce(x, self.group_name)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        return torch.ops.sgl_piecewise.all_gather(x, dim, self.size, self.group_name)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        return torch.ops.sgl_piecewise.reduce_scatter(x, self.size, self.group_name)

    def fuses_all_reduce_norm(self, hidden_size: int, dtype: torch.dtype, device: Union[str, torch.device]) -> bool:
        """Can a row-parallel projection's all-reduce, residual add and RMSNorm run
        as one op (``fused_norm.py``) here?"""
        return (
            self.size > 1
            and not self.splits_sequence
            and device is not None
            and torch.device(device).type == "cuda"
            and fused_norm.AVAILABLE
            and fused_norm.shape_ok(hidden_size, dtype)
        )

    def barrier(self) -> None:
        """Wait for every rank, on the host."""
        if self.size > 1:
            dist.barrier(group=self.cpu_group)

    def all_gather_object(self, obj: Any) -> List[Any]:
        if self.size == 1:
            return [obj]
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out


_SINGLE = TensorParallel(rank=0, size=1, group_name="")
_current: Optional[TensorParallel] = None
_owns_world = False  # destroy_tensor_parallel destroys torch.distributed's default group


def tensor_parallel() -> TensorParallel:
    return _SINGLE if _current is None else _current


def init_tensor_parallel(
    *, device: Union[str, torch.device, None] = None, timeout_s: float = 300, sequence_parallel: bool = False
) -> TensorParallel:
    """Build the group from torchrun's environment and make it current.
    ``device``: ``cuda`` (NCCL, GPU ``LOCAL_RANK``), ``cpu`` (gloo) or None
    (``cuda`` where visible). Without ``WORLD_SIZE`` (or 1), a single rank. A
    second call with the same world returns the current group; another raises."""
    _check_timeout(timeout_s)
    if not isinstance(sequence_parallel, bool):
        raise InvalidTypeError(f"sequence_parallel: expected a bool, got {sequence_parallel!r}")
    world = _env_int("WORLD_SIZE", 1)
    if world < 1:
        raise InvalidInputError(f"WORLD_SIZE: expected a positive int in the environment, got {world}")
    rank = _env_int("RANK", None) if world > 1 else 0
    if not 0 <= rank < world:
        raise InvalidInputError(f"RANK: expected 0 <= RANK < WORLD_SIZE={world}, got {rank}")
    dev = _rank_device(device, world)
    if _current is not None and _current.size > 1:
        if (_current.rank, _current.size, _current.device) == (rank, world, dev):
            if _current.sequence_parallel != sequence_parallel:
                _set_current(replace(_current, sequence_parallel=sequence_parallel))
            return _current
        raise InvalidInputError(
            f"init_tensor_parallel: expected the world already initialised (rank {_current.rank} of "
            f"{_current.size} on {_current.device}), got rank {rank} of {world} on {dev}; "
            "call destroy_tensor_parallel() first"
        )
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    tp = (
        TensorParallel(rank=0, size=1, group_name="", device=dev)
        if world == 1
        else _init_world(rank, world, dev, timeout_s)
    )
    _set_current(replace(tp, sequence_parallel=sequence_parallel))
    return _current


def destroy_tensor_parallel() -> None:
    """Destroy the current group (every rank calls it). The graphs captured while
    it was current are reset first: their NCCL kernels would block the
    communicators' destruction."""
    global _current, _owns_world
    tp, _current = _current, None
    if tp is None or tp.size == 1:
        return
    if tp.device is not None and tp.device.type == "cuda":
        torch.cuda.synchronize(tp.device)  # no replay still running when its graph is freed
    registry.reset_graphs(tp.group_name)
    registry.forget_group(tp.group_name)
    if tp.cpu_group is not tp.device_group:
        dist.destroy_process_group(tp.cpu_group)
    if _owns_world:
        dist.destroy_process_group()
    _owns_world = False


def track_graph(graph: "torch.cuda.CUDAGraph") -> None:
    """Note a just-captured graph, reset by :func:`destroy_tensor_parallel`."""
    if _current is not None and _current.size > 1:
        registry.add_graph(_current.group_name, graph)


def prepare_communication(max_tokens: int, hidden_size: int, dtype: torch.dtype, device) -> None:
    """Allocate what the group's small all-reduces use for ``max_tokens x
    hidden_size`` of ``dtype``: the symmetric-memory buffer and, with
    FlashInfer, the fused-norm workspace. Collective, before any capture (a
    graph bakes in the addresses). A no-op at one rank or on the CPU; where
    allocation fails, a warning, and NCCL or separate kernels serve."""
    check_positive_int("max_tokens", max_tokens)
    check_positive_int("hidden_size", hidden_size)
    if not isinstance(dtype, torch.dtype):
        raise InvalidTypeError(f"dtype: expected a torch.dtype, got {dtype!r}")
    device = torch.device(device)
    tp = tensor_parallel()
    if tp.size == 1 or device.type != "cuda":
        return
    if tp.device is not None and not same_device(device, tp.device):
        raise InvalidInputError(f"device: expected this rank's device {tp.device}, got {device}")
    if not symm_mem.AVAILABLE:
        logger.info("tensor parallel: all-reduces through NCCL only (%s)", symm_mem.UNAVAILABLE_REASON)
        return
    if torch.cuda.is_current_stream_capturing():
        raise InvalidInputError("prepare_communication: expected a call before any CUDA graph capture, got one during")
    if dtype in symm_mem.DTYPES:
        _prepare_one_shot(tp, max_tokens * hidden_size * dtype.itemsize, device)
    _prepare_fused_norm(tp, max_tokens, hidden_size, dtype, device)


def _prepare_one_shot(tp: TensorParallel, needed: int, device: torch.device) -> None:
    nbytes = _buffer_bytes(needed)
    if registry.symmetric_buffer_bytes(tp.group_name) >= nbytes:
        return
    try:
        buffer = symm_mem.allocate(nbytes, device, tp.group_name)
    except (RuntimeError, symm_mem.SymmMemUnavailable) as e:
        logger.warning("tensor parallel: no symmetric memory (%s); all-reduces go through NCCL", e)
        return
    registry.add_buffer(tp.group_name, buffer)


def _prepare_fused_norm(tp: TensorParallel, max_tokens: int, hidden_size: int, dtype: torch.dtype, device) -> None:
    """The fused-norm workspace; where FlashInfer cannot build on some rank, no
    rank allocates one (ranks must agree on the path)."""
    if not tp.fuses_all_reduce_norm(hidden_size, dtype, device):
        return
    measured = fused_norm.MAX_BYTES // (hidden_size * dtype.itemsize)
    tokens = min(max_tokens, measured, fused_norm.MAX_TOKENS)
    if tokens < 1 or fused_norm.serving(tp.group_name, torch.empty(tokens, hidden_size, dtype=dtype, device=device)):
        return
    try:
        fused_norm.build()
        error = None
    except Exception as e:  # whatever FlashInfer raises: the separate kernels serve
        error = f"{type(e).__name__}: {e}"
    errors = [f"rank {r}: {e}" for r, e in enumerate(tp.all_gather_object(error)) if e is not None]
    if errors:
        logger.warning("tensor parallel: no fused all-reduce + RMSNorm (%s); separate kernels serve", "; ".join(errors))
        return
    fused_norm.allocate(tp.rank, tp.size, tokens, hidden_size, dtype, device, tp.group_name)


def symmetric_buffer_bytes() -> int:
    """The current group's symmetric buffer size (0: NCCL only)."""
    return registry.symmetric_buffer_bytes(tensor_parallel().group_name)


def _buffer_bytes(needed: int) -> int:
    """``needed`` capped at the small-message threshold, rounded up to 16 bytes."""
    nbytes = min(needed, comm_ops.SMALL_ALL_REDUCE_MAX_BYTES)
    return -(-nbytes // 16) * 16


def _init_world(rank: int, world: int, dev: torch.device, timeout_s: float) -> TensorParallel:
    global _owns_world
    set_safe_env()
    backend = "nccl" if dev.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if dist.is_initialized():
        _check_existing_world(rank, world, backend)
    else:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise InvalidInputError(f"{name}: expected it set in the environment (torchrun sets it), got nothing")
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}  # NCCL's communicator made now, not in a capture
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout, **kwargs)
        _owns_world = True
    device_group = dist.group.WORLD
    cpu_group = device_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    name = registry.register_group(device_group)
    return TensorParallel(rank, world, name, dev, device_group, cpu_group)


def _check_existing_world(rank: int, world: int, backend: str) -> None:
    got = (dist.get_rank(), dist.get_world_size())
    if got != (rank, world):
        raise InvalidInputError(
            f"torch.distributed: expected rank {rank} of {world} (the environment), got rank {got[0]} of {got[1]}"
        )
    if backend not in str(dist.get_backend()):
        raise InvalidInputError(f"torch.distributed: expected the {backend} backend, got {dist.get_backend()}")


def _set_current(tp: TensorParallel) -> None:
    global _current
    _current = tp


def _rank_device(device: Union[str, torch.device, None], world: int) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, (str, torch.device)):
        raise InvalidTypeError(f"device: expected a str or torch.device, got {type(device).__name__}")
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise InvalidInputError(f"device: expected cpu or cuda, got {dev}")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    if local_world > visible:
        raise InvalidInputError(f"WORLD_SIZE: expected at most the {visible} visible GPUs, got {local_world} ranks")
    index = _env_int("LOCAL_RANK", 0) if dev.index is None else dev.index
    if not 0 <= index < visible:
        raise InvalidInputError(f"LOCAL_RANK: expected a visible GPU index below {visible}, got {index}")
    return torch.device("cuda", index)


def _env_int(name: str, default: Optional[int]) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise InvalidInputError(
                f"{name}: expected it set in the environment (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, "
                "MASTER_ADDR, MASTER_PORT), got nothing"
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidInputError(f"{name}: expected an int in the environment, got {raw!r}") from None


def _check_timeout(timeout_s: object) -> None:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise InvalidInputError(f"timeout_s: expected a finite number of seconds > 0, got {timeout_s!r}")
