"""Run a function on several ranks of one host, as torchrun would start them
(tests, benchmarks, examples). A rank that raises ends the run:
:class:`RankFailedError` names the first rank that failed (a peer of a dead
rank fails after it) with its traceback.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, List, Optional

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.distributed.groups import destroy_tensor_parallel, init_tensor_parallel, set_safe_env
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError, SglPiecewiseError

# After a rank fails: how long the others get to end, then again after SIGTERM.
GRACE_S = 3.0
_POLL_S = 0.5


class RankFailedError(SglPiecewiseError, RuntimeError):
    """A rank of :func:`launch` failed: ``rank`` the first, ``cause`` its traceback."""

    def __init__(self, message: str, rank: int, cause: str):
        super().__init__(message)
        self.rank = rank
        self.cause = cause


class LaunchTimeoutError(SglPiecewiseError, TimeoutError):
    """The ranks did not finish within ``timeout_s``; every rank was ended."""


def launch(
    fn: Callable,
    nprocs: int,
    *args: Any,
    device: str = "cpu",
    timeout_s: Optional[float] = None,
    sequence_parallel: bool = False,
) -> List[Any]:
    """Run ``fn(*args)`` (module-level, picklable result) on ``nprocs`` new
    ranks of a group on ``device``; return the results in rank order.
    ``timeout_s`` bounds the run and every collective."""
    _check_fn(fn)
    check_positive_int("nprocs", nprocs)
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0
    ):
        raise InvalidInputError(f"timeout_s: expected None or a number of seconds > 0, got {timeout_s!r}")
    if not isinstance(sequence_parallel, bool):
        raise InvalidTypeError(f"sequence_parallel: expected a bool, got {sequence_parallel!r}")
    with tempfile.TemporaryDirectory(prefix="sgl-piecewise-launch-") as folder:
        setup = (nprocs, _free_port(), str(device), timeout_s, sequence_parallel, folder)
        context = mp.start_processes(_run_rank, args=(setup, fn, args), nprocs=nprocs, join=False, start_method="spawn")
        try:
            _join(context, timeout_s, folder)
        finally:
            _end_all(context)
        return [_load(Path(folder) / f"result-{rank}.pkl") for rank in range(nprocs)]


def _run_rank(local_rank: int, setup: tuple, fn: Callable, args: tuple) -> None:
    nprocs, port, device, timeout_s, sequence_parallel, folder = setup
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(local_rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(nprocs),
    )
    set_safe_env()
    try:
        timeout = {} if timeout_s is None else {"timeout_s": timeout_s}
        init_tensor_parallel(device=device, sequence_parallel=sequence_parallel, **timeout)
        result = fn(*args)
        _dump(Path(folder) / f"result-{local_rank}.pkl", result)
    except Exception:
        _dump(Path(folder) / f"error-{local_rank}.pkl", (time.time(), traceback.format_exc()))
        raise
    destroy_tensor_parallel()
    _exit_done()


def _exit_done() -> None:
    """End a finished rank without interpreter finalisation (``os._exit``): a
    gloo thread dropping a tensor then may abort the process. Exit handlers run
    first."""
    atexit._run_exitfuncs()  # what finalisation runs first (logging's flush too)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _join(context, timeout_s: Optional[float], folder: str) -> None:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not context.join(timeout=_POLL_S, grace_period=GRACE_S):
            if deadline is not None and time.monotonic() > deadline:
                running = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
                raise LaunchTimeoutError(
                    f"launch: expected the ranks to finish within {timeout_s} s, got ranks {running} still running; "
                    "every rank was ended"
                )
    except ProcessException as e:
        raise _first_failure(folder, e, len(context.processes)) from None


def _first_failure(folder: str, exc: ProcessException, nprocs: int) -> RankFailedError:
    """The rank that failed first; torch's own report where none recorded it."""
    records = []
    for rank in range(nprocs):
        path = Path(folder) / f"error-{rank}.pkl"
        if path.exists():
            when, text = _load(path)
            records.append((when, rank, text))
    if not records:
        return RankFailedError(
            f"rank {exc.error_index} of {nprocs} failed: {exc.msg.strip()}", exc.error_index, exc.msg
        )
    records.sort()
    _, rank, text = records[0]
    later = [r for _, r, _ in records[1:]]
    also = f" (ranks {later} failed after it)" if later else ""
    return RankFailedError(f"rank {rank} of {nprocs} failed{also}:\n{text}", rank, text)


def _end_all(context) -> None:
    alive = [p for p in context.processes if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _check_fn(fn: object) -> None:
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or not getattr(fn, "__module__", None) or "<" in qualname or "." in qualname:
        raise InvalidInputError(f"fn: expected a module-level function (spawn pickles it by name), got {fn!r}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dump(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(value, f)
    os.replace(tmp, path)  # a reader sees the whole file or none


def _load(path: Path) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)
