"""The forward context: the step's batch and attention backend, as the
attention ops of this thread see them.

The ops run outside Dynamo's view (they are opaque custom ops), so reading
this context costs no graph break and no recompile. The backend is typed by
the protocol below, the part of ``backends.base.AttentionBackend`` that this
layer and the ops call: the backends sit above this module.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol

import torch

from sgl_piecewise.batch_checks import check_batch
from sgl_piecewise.errors import NoForwardContextError
from sgl_piecewise.forward import ForwardBatch
from sgl_piecewise.memory import KVPool, ReqToTokenPool


class ContextBackend(Protocol):
    """What the forward context and the attention ops need of a backend."""

    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        scale: float,
    ) -> None: ...

    def write_kv_and_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        scale: float,
        num_tokens: int,
        out_cache_loc: torch.Tensor,
    ) -> bool: ...

    def layer_attend(self) -> Optional[Callable[..., bool]]: ...


@dataclass
class ForwardContext:
    batch: ForwardBatch
    backend: ContextBackend
    debug_checks: bool = False  # check every attention call's arguments, not the step's first only
    num_tokens: int = 0  # the batch's real tokens, summed once per step
    args_checked: bool = False  # an attention call of this step has had its arguments checked
    out_cache_loc: Optional[torch.Tensor] = None  # the real tokens' slots, sliced once per step
    # Set by the breakable runner while it captures or checks a step
    # (runners/breakable.py): the attention ops hand each call to it instead
    # of attending. None on every other path, where the ops pay one check.
    breakable: Optional[Callable[..., None]] = None
    # Set once a layer of this step attended through the backend's per-step
    # plan (``AttentionBackend.layer_attend``): the attention between compiled
    # pieces tries it first for every later layer.
    layer_attend: Optional[Callable[..., bool]] = None


_local = threading.local()


@contextlib.contextmanager
def forward_context(
    batch: ForwardBatch,
    backend: ContextBackend,
    *,
    check: bool = True,
    debug_checks: bool = False,
) -> Iterator[ForwardContext]:
    """Make ``batch`` and ``backend`` visible to the attention ops of this thread.

    The ops run outside Dynamo's view (they are opaque custom ops), so reading
    this context costs no graph break and no recompile.

    ``check``: validate ``batch`` against the backend's pools first
    (``batch_checks.check_batch``; ``debug_checks`` adds the device-side
    checks). Runners that validated the batch already, or that run their own
    padded static batches, pass ``check=False``. ``debug_checks`` also makes
    the attention between compiled pieces check its arguments at every layer
    (otherwise at the step's first layer: the rest share its shapes).
    """
    if check:
        check_batch(batch, backend.req_to_token_pool, backend.kv_pool, debug_checks=debug_checks)
    stack = _stack()
    n = batch.num_tokens
    loc = batch.out_cache_loc
    ctx = ForwardContext(batch, backend, debug_checks, n, out_cache_loc=loc if loc.shape[0] == n else loc[:n])
    stack.append(ctx)
    try:
        yield ctx
    finally:
        stack.pop()


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def get_forward_context() -> ForwardContext:
    stack = _stack()
    if not stack:
        raise NoForwardContextError(
            "attention ran outside a forward context: expected "
            "`with sgl_piecewise.forward_context(batch, backend): model(...)`, got none"
        )
    return stack[-1]
