"""The attention backend contract (docs/ARCHITECTURE.md, "Attention backend
contract"): eager ``init_forward_metadata(batch)`` before each step, or
``init_cuda_graph_state`` once and then, per captured batch size, the
capture and replay hooks. A backend declares what it serves
(``supported_modes``, ``supports_cuda_graph``); callers check ``supports``.
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
    """A backend's optional dependency (the ``gpu`` extra) is not installed."""


class RecordedFill(Protocol):
    """A metadata fill recorded once and replayed (``graphs/fill_graphs.py``)."""

    def run(self, fill: Callable[..., None], inputs: Tuple[torch.Tensor, ...]) -> None: ...


FillRecorder = Callable[[str], RecordedFill]


class AttentionBackend(ABC):
    name: str = "abstract"
    supported_modes: FrozenSet[ForwardMode] = ALL_MODES
    supports_cuda_graph: bool = False
    # False: runners pass no host lengths (None, SEQ_LENS_SUM_UNKNOWN) to the replay hook.
    replay_reads_host_lengths: bool = True
    # True: a step's metadata may be prepared while the step before it runs. False where
    # preparing rewrites host memory that a queued copy of the earlier step may still read.
    prepares_ahead: bool = True

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: KVPool,
        num_q_heads: Optional[int] = None,
    ):
        """``num_q_heads``: query heads per layer; required by triton and flashinfer."""
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.num_q_heads = num_q_heads

    def supports(self, mode: ForwardMode) -> bool:
        return mode in self.supported_modes

    def check_supported(self, mode: ForwardMode) -> None:
        if not self.supports(mode):
            raise UnsupportedModeError(
                f"{self.name} backend: expected one of {sorted(m.name for m in self.supported_modes)}, got {mode.name}"
            )

    def init_forward_metadata(self, batch: ForwardBatch, *, check: bool = True) -> None:
        """Prepare kernel metadata for ``batch``; ``check=False`` for a batch
        already validated (``check_batch``)."""
        if check:
            check_metadata_batch(batch, self.req_to_token_pool, self.kv_pool)
        self.prepare_metadata(batch)

    @abstractmethod
    def prepare_metadata(self, batch: ForwardBatch) -> None:
        """The eager metadata of a validated ``batch``."""

    def reserve_eager_bindings(self, max_bs: int, max_num_tokens: int) -> None:
        """Let eager steps up to these sizes fill static buffers, where the
        backend can (``StaticGraphBackend``); a no-op here."""
        return None

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
        """Offer the caller's graph of ``(forward_mode, bs)`` the replay hook's
        metadata fill; True where taken up (``StaticGraphBackend``)."""
        return False

    def use_fill_recorder(self, recorder: Optional[FillRecorder]) -> None:
        """Record bound metadata fills with ``recorder`` (None: not at all); a no-op here."""
        return None

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """``seq_lens`` value written into padded requests of a graph batch."""
        return 1

    def cuda_graph_buffers(self) -> Dict[str, torch.Tensor]:
        """Every static buffer the capture/replay hooks write, by name (the
        newest ``init_cuda_graph_state``'s); none moves while a graph reads it."""
        return {}

    def _no_graphs(self) -> None:
        raise UnsupportedModeError(
            f"{self.name} backend: expected a backend with supports_cuda_graph=True "
            f"for graph capture, got one without it; use the graph-safe torch, "
            f"triton or flashinfer backend"
        )

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
        """Attend the batch's ``num_tokens`` new rows (their K/V already in the
        pool); write ``out [T, Hq, Dv]`` in place."""
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
        """The attention op's one way into a backend: write the K/V of the
        ``num_tokens`` real rows, attend, zero ``out``'s padded rows. True where
        the call built a per-step plan that :meth:`layer_attend` gives later
        layers. This default writes K/V and calls :meth:`forward`."""
        # Slices and zeroing only where rows are padded (a launch each, per layer per step).
        padded = q.shape[0] > num_tokens
        if num_tokens:
            o = out
            if padded:
                q, k, v, o = q[:num_tokens], k[:num_tokens], v[:num_tokens], out[:num_tokens]
            self.kv_pool.set_kv(layer_id, out_cache_loc, k, v)
            self.forward(q, k, v, o, layer_id, batch, scale)
        if padded:
            out[num_tokens:].zero_()
        return False

    def layer_attend(self) -> Optional[Callable[..., bool]]:
        """After ``write_kv_and_attend`` returned True: ``attend(q, k, v, out,
        layer_id, scale) -> bool`` for later layers of the step, checking only
        what differs between layers (False: nothing launched); or None."""
        return None

    @abstractmethod
    def forward_decode(self, q, k, v, out, layer_id, batch, scale) -> None: ...

    @abstractmethod
    def forward_extend(self, q, k, v, out, layer_id, batch, scale) -> None: ...
