"""Pattern A for backends whose per-step state is tensors: ``StaticBuffers``
and ``StaticGraphBackend``, the base of the torch, triton and flashinfer
backends. Every path fills its metadata with the one ``_fill_metadata``;
capture binds views of the static buffers and delegates to replay
(docs/ARCHITECTURE.md, "The capture/replay contract").
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Dict, Optional, Set, Tuple

import torch

from sgl_piecewise.backends.base import AttentionBackend, FillRecorder, RecordedFill
from sgl_piecewise.backends.metadata import (
    SEQ_LENS_SUM_UNKNOWN,
    LengthMetadata,
    graph_query_width,
    has_custom_mask,
)
from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.forward import ForwardBatch, ForwardMode

# Eager steps a binding can serve: no tree mask, lengths from the batch alone.
_EAGER_BOUND_MODES = frozenset((ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED))


class StaticBuffers:
    """Named device buffers allocated once; graph metadata fields are views of them."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: Dict[str, torch.Tensor] = {}

    def alloc(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = torch.zeros(shape, dtype=dtype, device=self.device)
        self._buffers[name] = buf
        return buf

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._buffers[name]

    def alloc_lengths(self, max_bs: int) -> None:
        """The buffers behind every ``LengthMetadata`` field, for any backend."""
        for name in ("q_lens", "kv_lens"):
            self.alloc(name, (max_bs,), torch.int32)
        for name in ("qo_indptr", "kv_indptr"):
            self.alloc(name, (max_bs + 1,), torch.int32)

    def length_views(self, bs: int, width: int, mode: ForwardMode, masked: bool) -> Dict[str, object]:
        """``LengthMetadata`` fields for ``bs`` requests of ``width`` rows, as views."""
        return dict(
            forward_mode=mode,
            bs=bs,
            max_q_len=width,
            num_tokens=bs * width,
            q_lens=self["q_lens"][:bs],
            kv_lens=self["kv_lens"][:bs],
            qo_indptr=self["qo_indptr"][: bs + 1],
            kv_indptr=self["kv_indptr"][: bs + 1],
            masked=masked,
        )

    def as_dict(self) -> Dict[str, torch.Tensor]:
        return dict(self._buffers)


class StaticGraphBackend(AttentionBackend):
    """Pattern A (docs/ARCHITECTURE.md, "Pattern A and Pattern B"): eager steps
    ``_alloc_metadata``; capture ``_bind_metadata`` per ``(mode, bs)`` and
    delegates to replay, which fills the binding. Subclasses implement the
    four abstract steps and ``forward_decode``/``forward_extend``.

    A bound fill on CUDA is recorded once and replayed where ``fill_on_device``;
    with ``eager_steps_bound``, eager steps fill a binding too.
    """

    supports_cuda_graph = True
    replay_reads_host_lengths = False
    fill_on_device = True  # False where the fill also runs host work
    eager_steps_bound = False

    def __init__(self, req_to_token_pool, kv_pool, num_q_heads: Optional[int] = None):
        super().__init__(req_to_token_pool, kv_pool, num_q_heads)
        self.forward_metadata: Optional[LengthMetadata] = None
        self._buffers: Optional[StaticBuffers] = None
        self._graph_metadata: Dict[Tuple[ForwardMode, int], LengthMetadata] = {}
        self._eager_metadata: Dict[Tuple[ForwardMode, int], LengthMetadata] = {}
        self._fill_graphs: Dict[Tuple[str, ForwardMode, int], RecordedFill] = {}
        self._fill_recorder: Optional[FillRecorder] = None
        # Bindings whose fill a caller's graph holds: the input addresses it reads.
        self._caller_graph_fills: Dict[Tuple[str, ForwardMode, int], Set[Tuple[int, int]]] = {}
        self.max_bs = 0
        self.max_num_tokens = 0

    @abstractmethod
    def _alloc_metadata(self, batch: ForwardBatch) -> LengthMetadata:
        """Fresh, unfilled metadata sized for an eager ``batch``."""

    @abstractmethod
    def _alloc_graph_buffers(self, buffers: StaticBuffers, max_bs: int, max_num_tokens: int) -> None:
        """Allocate every static buffer any captured batch size will view."""

    @abstractmethod
    def _bind_metadata(self, bs: int, width: int, mode: ForwardMode, spec_info) -> LengthMetadata:
        """Unfilled metadata whose tensors are views of the static buffers."""

    @abstractmethod
    def _fill_metadata(self, meta, bs, req_pool_indices, seq_lens, extend_lens, mode, spec_info) -> None:
        """Write every runtime value of ``meta``, on every path. ``extend_lens``
        None: every request has ``meta.max_q_len`` new tokens."""

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        self.check_supported(batch.forward_mode)
        if self._eager_binding_fits(batch):
            self._fill_eager_bound(batch)
            return
        meta = self._alloc_metadata(batch)
        self._fill_metadata(
            meta,
            batch.batch_size,
            batch.req_pool_indices,
            batch.seq_lens,
            batch.extend_seq_lens,
            batch.forward_mode,
            batch.spec_info,
        )
        self.forward_metadata = meta

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Static buffers for graphs up to these sizes. A later, larger call
        adds a new generation; earlier bindings keep the buffers their graphs read."""
        max_bs = check_positive_int("max_bs", max_bs)
        max_num_tokens = check_positive_int("max_num_tokens", max_num_tokens)
        if self._buffers is not None and max_bs <= self.max_bs and max_num_tokens <= self.max_num_tokens:
            return
        self.max_bs, self.max_num_tokens = max(max_bs, self.max_bs), max(max_num_tokens, self.max_num_tokens)
        self._buffers = StaticBuffers(self.kv_pool.device)
        self._alloc_graph_buffers(self._buffers, self.max_bs, self.max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(
        self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens, forward_mode, spec_info
    ) -> None:
        self.check_supported(forward_mode)
        width = self._check_graph_batch(bs, forward_mode, spec_info)
        if not forward_mode.is_idle() and num_tokens != bs * width:
            raise InvalidInputError(
                f"capture: expected num_tokens = bs * {width} = {bs * width} for {forward_mode.name}, got {num_tokens}"
            )
        # Bind first so replay finds this size; a size bound before keeps its
        # binding, since graphs captured on it read those views.
        key = (forward_mode, bs)
        if key not in self._graph_metadata:
            self._graph_metadata[key] = self._bind_metadata(bs, width, forward_mode, spec_info)
        self._check_bound(self._graph_metadata[key], bs, width, spec_info)
        # A new graph over these inputs: its caller says again whether it holds the fill.
        held = self._caller_graph_fills.get(_graph_key(forward_mode, bs))
        if held is not None:
            held.discard(_addresses(req_pool_indices, seq_lens))
        self.init_forward_metadata_replay_cuda_graph(
            bs,
            req_pool_indices,
            seq_lens,
            SEQ_LENS_SUM_UNKNOWN,
            encoder_lens,
            forward_mode,
            spec_info,
            seq_lens_cpu=None,
        )

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs,
        req_pool_indices,
        seq_lens,
        seq_lens_sum,
        encoder_lens,
        forward_mode,
        spec_info,
        seq_lens_cpu=None,
    ) -> None:
        meta = self._graph_metadata.get((forward_mode, bs))
        if meta is None:
            raise InvalidInputError(
                f"replay: expected a batch size captured for {forward_mode.name} "
                f"({sorted(b for m, b in self._graph_metadata if m == forward_mode)}), got {bs}; "
                f"call init_forward_metadata_capture_cuda_graph first"
            )
        width = self._check_graph_batch(bs, forward_mode, spec_info)
        self._check_bound(meta, bs, width, spec_info)
        # max_q_len / num_tokens were fixed at bind and no fill rewrites them.
        key = _graph_key(forward_mode, bs)
        if not self._filled_by_caller_graph(key, req_pool_indices, seq_lens):
            self._fill_bound(key, meta, _graph_inputs(bs, req_pool_indices, seq_lens), spec_info)
        self._begin_step(meta)
        self.forward_metadata = meta

    def fill_in_graph(self, forward_mode, bs, req_pool_indices, seq_lens) -> bool:
        """Let the caller's graph of ``(forward_mode, bs)`` hold this binding's
        fill: a replay hook given exactly these tensors then only checks the
        step, and the caller must replay its graph next. False where the fill
        cannot be recorded (off CUDA, a tree mask, host work, no binding).
        """
        meta = self._graph_metadata.get((forward_mode, bs))
        if meta is None or not self.fill_on_device or not can_record_fill(seq_lens.device, meta.masked):
            return False
        addresses = _addresses(req_pool_indices, seq_lens)
        self._caller_graph_fills.setdefault(_graph_key(forward_mode, bs), set()).add(addresses)
        return True

    def _filled_by_caller_graph(self, key, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> bool:
        """Does a caller's graph fill this binding from these tensors (never while capturing)?"""
        ptrs = self._caller_graph_fills.get(key)
        if ptrs is None or torch.cuda.is_current_stream_capturing():
            return False
        return _addresses(req_pool_indices, seq_lens) in ptrs

    def _begin_step(self, meta: LengthMetadata) -> None:
        """Drop the per-step host state a subclass keeps on a binding."""

    def _fill_bound(self, key, meta: LengthMetadata, inputs: Tuple[torch.Tensor, ...], spec_info) -> None:
        """Fill a binding from ``(req_pool_indices, seq_lens[, extend_lens])``,
        through its recorded fill where exact, else with plain operations."""
        bs, mode = meta.bs, meta.forward_mode

        def fill(req_pool_indices, seq_lens, extend_lens=None) -> None:
            self._fill_metadata(meta, bs, req_pool_indices, seq_lens, extend_lens, mode, spec_info)

        graph = self._fill_graphs.get(key)
        device = inputs[0].device
        recorder = self._fill_recorder
        if graph is None and recorder is not None and self.fill_on_device and can_record_fill(device, meta.masked):
            graph = self._fill_graphs[key] = recorder(f"{self.name} metadata fill of {mode.name} bs {bs}")
        if graph is None or torch.cuda.is_current_stream_capturing():
            fill(*inputs)
        else:
            graph.run(fill, inputs)

    def use_fill_recorder(self, recorder: Optional[FillRecorder]) -> None:
        self._fill_recorder = recorder

    def reserve_eager_bindings(self, max_bs: int, max_num_tokens: int) -> None:
        if self.eager_steps_bound:
            self.init_cuda_graph_state(max_bs, max_num_tokens)

    def _eager_binding_fits(self, batch: ForwardBatch) -> bool:
        return (
            self.eager_steps_bound
            and self._buffers is not None
            and batch.forward_mode in _EAGER_BOUND_MODES
            and 0 < batch.batch_size <= self.max_bs
            and not has_custom_mask(batch.spec_info)
        )

    def _fill_eager_bound(self, batch: ForwardBatch) -> None:
        """An eager step filled into static buffers: DECODE's graph binding of
        its size if any, else an eager binding. A ragged step's host sizes come
        from the batch: they size the launches, not the buffers."""
        bs, mode = batch.batch_size, batch.forward_mode
        if mode.is_decode() and (mode, bs) in self._graph_metadata:
            key, meta = ("graph", mode, bs), self._graph_metadata[(mode, bs)]
        else:
            key = ("eager", mode, bs)
            meta = self._eager_metadata.get((mode, bs))
            if meta is None:
                meta = self._eager_metadata[(mode, bs)] = self._bind_metadata(bs, 1, mode, batch.spec_info)
        inputs = (batch.req_pool_indices, batch.seq_lens)
        if not mode.is_decode():
            meta.max_q_len = max(batch.extend_seq_lens_cpu)
            meta.num_tokens = batch.num_tokens
            inputs += (batch.extend_seq_lens,)
        self._fill_bound(key, meta, inputs, batch.spec_info)
        self._begin_step(meta)
        self.forward_metadata = meta

    @staticmethod
    def _check_bound(meta: LengthMetadata, bs: int, width: int, spec_info) -> None:
        """The step fits its binding's width and mask kind, fixed at capture."""
        if width != meta.max_q_len:
            raise InvalidInputError(
                f"graph batch of {bs}: expected {meta.max_q_len} tokens per request (captured), got {width}"
            )
        if meta.masked != has_custom_mask(spec_info):
            want = "a" if meta.masked else "no"
            raise InvalidInputError(
                f"graph batch of {bs}: expected {want} spec_info.custom_mask (as at capture), "
                f"got the opposite; capture a graph per mask kind"
            )

    def cuda_graph_buffers(self) -> Dict[str, torch.Tensor]:
        return self._buffers.as_dict() if self._buffers is not None else {}

    def _new(self, *shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """An uninitialised eager metadata tensor on the pool's device."""
        return torch.empty(shape, dtype=dtype, device=self.kv_pool.device)

    def _check_graph_batch(self, bs: int, mode: ForwardMode, spec_info) -> int:
        if self._buffers is None:
            raise InvalidInputError(
                f"{self.name} backend: expected init_cuda_graph_state before capture/replay, got none"
            )
        width = graph_query_width(mode, spec_info)
        if not 0 < bs <= self.max_bs or bs * width > self.max_num_tokens:
            raise InvalidInputError(
                f"graph batch: expected 0 < bs <= {self.max_bs} and bs * {width} <= "
                f"{self.max_num_tokens} tokens, got bs {bs}; raise init_cuda_graph_state's limits"
            )
        return width

    def _current_metadata(self, q: torch.Tensor, batch: ForwardBatch) -> LengthMetadata:
        """The step's metadata, checked against the batch and query rows the op passes."""
        meta = self.forward_metadata
        if meta is None or meta.forward_mode != batch.forward_mode:
            got = "none" if meta is None else f"metadata for {meta.forward_mode.name}"
            raise InvalidInputError(
                f"{self.name} backend: expected init_forward_metadata or a replay hook for "
                f"{batch.forward_mode.name} before attention, got {got}"
            )
        if q.shape[0] != meta.num_tokens:
            raise InvalidInputError(
                f"q: expected the metadata's {meta.num_tokens} query rows ({meta.bs} requests), "
                f"got {q.shape[0]}; was the metadata prepared for this batch?"
            )
        return meta


def _graph_key(forward_mode: ForwardMode, bs: int) -> tuple:
    return ("graph", forward_mode, bs)


def _graph_inputs(bs: int, req_pool_indices, seq_lens) -> tuple:
    return req_pool_indices[:bs], seq_lens[:bs]


def _addresses(req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> Tuple[int, int]:
    """Where a fill's inputs lie; the first ``bs`` rows start where their tensors do."""
    return req_pool_indices.data_ptr(), seq_lens.data_ptr()


def can_record_fill(device: torch.device, masked: bool) -> bool:
    """May a bound fill be recorded now: on CUDA, without a tree mask (its
    length changes each step), outside another capture?"""
    return device.type == "cuda" and not masked and not torch.cuda.is_current_stream_capturing()
