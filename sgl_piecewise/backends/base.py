"""The attention backend contract (docs/ARCHITECTURE.md, "Attention backend contract").

A backend turns a ``ForwardBatch`` into kernel metadata and runs attention over
the paged KV pool. Three ways in:

* eager: ``init_forward_metadata(batch)`` before each step: the batch
  checked against the backend's pools, then the backend's
  ``prepare_metadata``;
* CUDA graph: ``init_cuda_graph_state`` once, then per captured batch size
  ``init_forward_metadata_capture_cuda_graph`` while capturing and
  ``init_forward_metadata_replay_cuda_graph`` before each replay.

Capture must be Pattern A (bind metadata fields to views of the static
buffers, then call replay to fill them) or Pattern B (one creation helper
shared by capture and replay; capture calls replay once). Lengths are computed
with ``backends/lengths.py`` on every path.

A backend declares what it serves (``supported_modes``,
``supports_cuda_graph``); callers check ``supports(mode)`` and fall back
instead of getting a silent wrong answer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Dict, FrozenSet, Optional, Protocol, Tuple

import torch

from sgl_piecewise.batch_checks import check_metadata_batch
from sgl_piecewise.errors import SglPiecewiseError, UnsupportedModeError
from sgl_piecewise.forward import ForwardBatch, ForwardMode, SpecInfo
from sgl_piecewise.memory import KVPool, ReqToTokenPool

ALL_MODES: FrozenSet[ForwardMode] = frozenset(ForwardMode)


class BackendUnavailableError(SglPiecewiseError, ImportError):
    """A backend's optional dependency (``triton``, ``flashinfer``: the ``gpu``
    extra) is not installed."""


class RecordedFill(Protocol):
    """A metadata fill recorded once and replayed (``graphs/fill_graphs.py``)."""

    def run(self, fill: Callable[..., None], inputs: Tuple[torch.Tensor, ...]) -> None: ...


# Makes the recorded fill of one binding, given a name for its capture.
FillRecorder = Callable[[str], RecordedFill]


class AttentionBackend(ABC):
    name: str = "abstract"
    supported_modes: FrozenSet[ForwardMode] = ALL_MODES
    supports_cuda_graph: bool = False
    # Whether the replay hook reads the host lengths it is passed
    # (``seq_lens_cpu``, ``seq_lens_sum``). SGLang's hook signature passes
    # them, so a backend written for it may; where False, a graph runner
    # keeps no host copy of the lengths and passes None and
    # ``SEQ_LENS_SUM_UNKNOWN`` (a copy and a sum fewer before every replay).
    replay_reads_host_lengths: bool = True

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: KVPool,
        num_q_heads: Optional[int] = None,
    ):
        """``num_q_heads``: query heads per layer. Backends whose static buffers
        or kernel plans depend on it (triton, flashinfer) require it; the others
        accept and ignore it, so every backend is built the same way."""
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.num_q_heads = num_q_heads

    # ---- capability -------------------------------------------------------
    def supports(self, mode: ForwardMode) -> bool:
        return mode in self.supported_modes

    def check_supported(self, mode: ForwardMode) -> None:
        if not self.supports(mode):
            raise UnsupportedModeError(
                f"{self.name} backend: expected one of {sorted(m.name for m in self.supported_modes)}, got {mode.name}"
            )

    # ---- eager ------------------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch, *, check: bool = True) -> None:
        """Prepare kernel metadata for ``batch`` (eager path).

        ``check``: refuse first a batch the metadata cannot describe
        (``batch_checks.check_metadata_batch``), with its reason rather than
        an ``IndexError`` from deep in a fill; a caller that validated the
        batch already (``check_batch``) passes False.
        """
        if check:
            check_metadata_batch(batch, self.req_to_token_pool, self.kv_pool)
        self.prepare_metadata(batch)

    @abstractmethod
    def prepare_metadata(self, batch: ForwardBatch) -> None:
        """The eager metadata of a validated ``batch`` (``init_forward_metadata``)."""

    def reserve_eager_bindings(self, max_bs: int, max_num_tokens: int) -> None:
        """Room for eager steps of up to ``max_bs`` requests and
        ``max_num_tokens`` tokens to fill static buffers instead of fresh
        tensors, where the backend does that (``StaticGraphBackend``'s
        ``eager_steps_bound``); a no-op elsewhere. Runners whose attention
        runs eagerly (piecewise, breakable) call it."""
        return None  # here eager steps always fill fresh tensors

    # ---- CUDA graph -------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._no_graphs()

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        encoder_lens: Optional[torch.Tensor],
        forward_mode: ForwardMode,
        spec_info: Optional[SpecInfo],
    ) -> None:
        self._no_graphs()

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        encoder_lens: Optional[torch.Tensor],
        forward_mode: ForwardMode,
        spec_info: Optional[SpecInfo],
        seq_lens_cpu: Optional[torch.Tensor],
    ) -> None:
        self._no_graphs()

    def fill_in_graph(
        self, forward_mode: ForwardMode, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> bool:
        """Offer the caller's graph of ``(forward_mode, bs)`` the replay
        hook's metadata fill; True where the backend takes it up
        (``StaticGraphBackend.fill_in_graph`` says how). Here False: the
        replay hook fills before every replay."""
        return False

    def use_fill_recorder(self, recorder: Optional[FillRecorder]) -> None:
        """Record bound metadata fills as graphs with ``recorder`` (the graph
        layer's ``graphs.fill_graphs.FillGraph``), or not at all with None.
        Backends sit below the graph machinery: it hands them the recorder.
        Here nothing is recorded."""
        return None

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """``seq_lens`` value written into padded requests of a graph batch."""
        return 1

    def cuda_graph_buffers(self) -> Dict[str, torch.Tensor]:
        """Every static buffer the capture/replay hooks write, by name.

        Captured kernels read these addresses, so none moves while a graph
        reads it; a later, larger ``init_cuda_graph_state`` adds buffers for
        the sizes captured after it, and this returns the newest ones. Tests
        compare them byte for byte between capture and replay of the same
        batch (upstream SGLang PRs 26665 and 22404). Empty for backends
        without graphs.
        """
        return {}

    def _no_graphs(self) -> None:
        raise UnsupportedModeError(
            f"{self.name} backend: expected a backend with supports_cuda_graph=True "
            f"for graph capture, got one without it; use the graph-safe torch, "
            f"triton or flashinfer backend"
        )

    # ---- attention --------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        scale: float,
    ) -> None:
        """Attend the batch's new tokens; write ``out [T, Hq, Dv]`` in place.

        ``q, k, v`` hold exactly the batch's ``num_tokens`` rows; their K/V is
        already in the pool.
        """
        mode = batch.forward_mode
        self.check_supported(mode)
        if mode.is_idle() or q.shape[0] == 0:
            return
        if mode.is_decode():
            self.forward_decode(q, k, v, out, layer_id, batch, scale)
        else:
            self.forward_extend(q, k, v, out, layer_id, batch, scale)

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
    ) -> bool:
        """The attention op's whole work in one call, where the backend has a
        kernel for it: write the K/V of the ``num_tokens`` real rows at
        ``out_cache_loc``, attend, and zero ``out``'s rows past them (``q, k,
        v, out`` may hold a graph's padded rows). Returns False where it has
        none for this step; the op then writes the K/V itself and calls
        :meth:`forward` on the real rows."""
        return False

    def layer_attend(self) -> Optional[Callable[..., bool]]:
        """After ``write_kv_and_attend`` returned True: a callable that attends
        a later layer of the same step, ``attend(q, k, v, out, layer_id,
        scale) -> bool`` (``scale`` resolved, never None), checking only what can differ between layers and
        returning False (nothing launched) for anything else, or None. The
        attention between compiled pieces calls it first, so that per layer
        only the K/V write and the kernel launch remain."""
        return None

    @abstractmethod
    def forward_decode(self, q, k, v, out, layer_id, batch, scale) -> None: ...

    @abstractmethod
    def forward_extend(self, q, k, v, out, layer_id, batch, scale) -> None: ...
