"""The forward context: the step's batch and attention backend, as the
attention ops of this thread see them. The ops are opaque custom ops, so
reading it costs no graph break; the backend is typed by a protocol, as
the backends sit above this module.
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
    # Set once a layer attended through the backend's per-step plan (``layer_attend``).
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
    """Make ``batch`` and ``backend`` visible to this thread's attention ops.
    ``check``: validate ``batch`` first (runners that did, or that run their own
    static batches, pass False); ``debug_checks`` adds the device checks and
    checks the attention arguments at every layer, not the step's first only."""
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
