"""The tensor-parallel group: its ranks, its process groups, and its
collectives as methods.

:func:`init_tensor_parallel` builds the group from the environment torchrun
sets and makes it current; :func:`tensor_parallel` returns the current one,
or a single rank where none was built, so a model written for tensor
parallelism runs unchanged on one device. The collectives return their
input itself at one rank: no op, no copy, nothing in a traced graph.

Two process groups on the same ranks: the device group (NCCL on CUDA, gloo
on the CPU) runs the collectives of the forward pass; a gloo group runs
barriers and object exchanges on the host, so those never queue behind the
device's work (on the CPU the two are one).
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

# Never multicast (NVLS): set before NCCL or symmetric memory starts. The
# GPU hosts this library runs on are shared, and multicast objects there are
# off for everyone; a value that would turn it on is overridden (logged).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def set_safe_env(environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Set :data:`SAFE_ENV`'s variables in ``environ`` (the process's
    environment by default), whatever it held; never unsets one."""
    environ = os.environ if environ is None else environ
    for name, value in SAFE_ENV.items():
        held = environ.get(name)
        if held is not None and held != value:
            logger.warning("tensor parallel: %s=%s would allow NVLink multicast; set to %s", name, held, value)
        environ[name] = value


@dataclass(frozen=True)
class TensorParallel:
    """One rank's view of its tensor-parallel group.

    ``group_name`` is the device process group's name ("" at one rank): the
    communication ops take it. ``device`` is this rank's device (None for
    the single rank :func:`tensor_parallel` returns when none was built).
    ``sequence_parallel``: models built in this group split their residual
    stream across the ranks by tokens (``models/layers.py``); nothing at one
    rank.
    """

    rank: int
    size: int
    group_name: str
    device: Optional[torch.device] = None
    device_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    cpu_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    sequence_parallel: bool = False

    def __deepcopy__(self, memo: dict) -> "TensorParallel":
        """The group itself: a copy of a model (an fp32 twin) is a model of
        the same ranks, and process groups cannot be copied."""
        return self

    @property
    def splits_sequence(self) -> bool:
        """Is the residual stream split across several ranks by tokens?"""
        return self.size > 1 and self.sequence_parallel

    @property
    def is_first(self) -> bool:
        """Rank 0: the rank that prints."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, as a new tensor; ``x`` itself at one rank."""
        if self.size == 1:
            return x
        return torch.ops.sgl_piecewise.all_reduce(x, self.group_name)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order; ``x`` at one rank."""
        if self.size == 1:
            return x
        return torch.ops.sgl_piecewise.all_gather(x, dim, self.size, self.group_name)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, then this rank's ``1/size`` share of dim 0
        (which ``size`` must divide); ``x`` at one rank."""
        if self.size == 1:
            return x
        return torch.ops.sgl_piecewise.reduce_scatter(x, self.size, self.group_name)

    def fuses_all_reduce_norm(self, hidden_size: int, dtype: torch.dtype, device: Union[str, torch.device]) -> bool:
        """Can a model's row-parallel projection of ``hidden_size`` outputs in
        ``dtype`` on ``device`` all-reduce, add its residual and normalise
        in one op (``fused_norm.py``)? Where the group has several ranks on
        CUDA, the stream is not split by tokens, FlashInfer is installed and
        its kernel takes the rows. A model asks when it is built."""
        return (
            self.size > 1
            and not self.splits_sequence
            and device is not None
            and torch.device(device).type == "cuda"
            and fused_norm.AVAILABLE
            and fused_norm.shape_ok(hidden_size, dtype)
        )

    def barrier(self) -> None:
        """Wait for every rank, on the host (the gloo group)."""
        if self.size > 1:
            dist.barrier(group=self.cpu_group)

    def all_gather_object(self, obj: Any) -> List[Any]:
        """Every rank's picklable ``obj``, in rank order (the gloo group)."""
        if self.size == 1:
            return [obj]
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out


_SINGLE = TensorParallel(rank=0, size=1, group_name="")
_current: Optional[TensorParallel] = None
_owns_world = False  # whether destroy_tensor_parallel destroys torch.distributed's default group


def tensor_parallel() -> TensorParallel:
    """The current group; a single rank where none was initialised."""
    return _SINGLE if _current is None else _current


def init_tensor_parallel(
    *, device: Union[str, torch.device, None] = None, timeout_s: float = 300, sequence_parallel: bool = False
) -> TensorParallel:
    """Build the group from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and make it current.

    ``device``: ``cuda`` (NCCL; this rank's GPU is ``LOCAL_RANK``, or the
    index given, and becomes the current device), ``cpu`` (gloo), or None
    for ``cuda`` where a GPU is visible. Without ``WORLD_SIZE``, or with 1,
    the group is a single rank and no process group is made. ``timeout_s``
    bounds every collective's wait. ``sequence_parallel``: the models built
    in the group split their residual stream by tokens
    (:attr:`TensorParallel.sequence_parallel`). A second call with the same
    world returns the current group (with this ``sequence_parallel`` for
    the models built from then on); with another, it raises (destroy first). If
    ``torch.distributed`` was initialised already, its default group is the
    device group (it must match the environment and the device).
    """
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
    """Destroy the current group's process groups and forget its buffers;
    :func:`tensor_parallel` returns a single rank again. Every rank calls it.

    The CUDA graphs captured while the group was current
    (:func:`track_graph`) are reset first: their NCCL kernels would keep
    the communicators from being destroyed, and a replay after the group is
    gone has no peer to meet. Replaying one afterwards raises torch's error."""
    global _current, _owns_world
    tp, _current = _current, None
    if tp is None or tp.size == 1:
        return
    if tp.device is not None and tp.device.type == "cuda":
        torch.cuda.synchronize(tp.device)  # no replay still running when its graph is freed
    registry.reset_graphs(tp.group_name)  # else NCCL waits for them (registry.py)
    registry.forget_group(tp.group_name)
    if tp.cpu_group is not tp.device_group:
        dist.destroy_process_group(tp.cpu_group)
    if _owns_world:
        dist.destroy_process_group()
    _owns_world = False


def track_graph(graph: "torch.cuda.CUDAGraph") -> None:
    """Note a CUDA graph just captured: where the current group has several
    ranks, :func:`destroy_tensor_parallel` resets it (it may hold the group's
    collectives). The capture core calls it for every graph it records."""
    if _current is not None and _current.size > 1:
        registry.add_graph(_current.group_name, graph)


def prepare_communication(max_tokens: int, hidden_size: int, dtype: torch.dtype, device) -> None:
    """Allocate what the current group's small all-reduces use, for
    ``max_tokens x hidden_size`` of ``dtype`` (capped at
    ``comm_ops.SMALL_ALL_REDUCE_MAX_BYTES`` a message: larger ones go
    through NCCL anyway): the symmetric-memory buffer of the one-shot and
    two-shot ops, and, where FlashInfer is installed, the workspace of the
    fused all-reduce + residual add + RMSNorm (``fused_norm.py``; capped at
    its own ``MAX_BYTES``).

    Call it once, on every rank with the same arguments (the buffers'
    handles are exchanged: a collective), before any CUDA graph is
    captured: a capture bakes in the buffers' addresses and cannot allocate
    them. A no-op at one rank, on the CPU, where symmetric memory is
    unavailable (logged), and for what is large enough already. A larger
    request allocates anew and keeps the old buffers for the graphs that
    use them. Where allocation fails (no peer access between the GPUs;
    FlashInfer cannot build on some rank), a warning is logged and separate
    kernels, or NCCL, serve.
    """
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
    """The workspace of the fused all-reduce + residual add + RMSNorm, for
    as many tokens as it is measured faster at (``fused_norm.py``). Where
    FlashInfer cannot build on some rank, no rank allocates one (logged):
    ranks that disagreed on the path would wait for each other forever.
    None where no projection can take it (``fuses_all_reduce_norm``: under
    sequence parallelism, say)."""
    if not tp.fuses_all_reduce_norm(hidden_size, dtype, device):
        return
    measured = fused_norm.MAX_BYTES // (hidden_size * dtype.itemsize)
    tokens = min(max_tokens, measured, fused_norm.MAX_TOKENS)
    if tokens < 1 or fused_norm.serving(tp.group_name, torch.empty(tokens, hidden_size, dtype=dtype, device=device)):
        return
    try:
        fused_norm.build()
        error = None
    except Exception as e:  # whatever FlashInfer raises where it cannot build: the separate kernels serve
        error = f"{type(e).__name__}: {e}"
    errors = [f"rank {r}: {e}" for r, e in enumerate(tp.all_gather_object(error)) if e is not None]
    if errors:
        logger.warning("tensor parallel: no fused all-reduce + RMSNorm (%s); separate kernels serve", "; ".join(errors))
        return
    fused_norm.allocate(tp.rank, tp.size, tokens, hidden_size, dtype, device, tp.group_name)


def symmetric_buffer_bytes() -> int:
    """The current group's symmetric-memory buffer size; 0 when its small
    all-reduces go through NCCL."""
    return registry.symmetric_buffer_bytes(tensor_parallel().group_name)


def _buffer_bytes(needed: int) -> int:
    """``needed`` capped at the small-message threshold, rounded up to 16
    bytes (the op's widest vector access)."""
    nbytes = min(needed, comm_ops.SMALL_ALL_REDUCE_MAX_BYTES)
    return -(-nbytes // 16) * 16


def _init_world(rank: int, world: int, dev: torch.device, timeout_s: float) -> TensorParallel:
    """The process groups of a world of several ranks."""
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
    """A world torch.distributed was initialised with by the caller must be this one."""
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
    """This rank's device: ``cuda`` means ``cuda:LOCAL_RANK``."""
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
