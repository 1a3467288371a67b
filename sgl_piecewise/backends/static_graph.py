"""The capture/replay contract as Pattern A, for backends whose whole per-step
state is tensors: ``StaticBuffers`` (named device buffers allocated once) and
``StaticGraphBackend``, the base class of the torch, triton and flashinfer
backends.

Every path goes through the same three steps: get a metadata object (fresh
tensors when eager, views of static buffers when graphed), fill it with the
backend's one ``_fill_metadata``, make it ``forward_metadata``. Capture binds
the views and delegates to replay, so the two cannot compute a value
differently (docs/ARCHITECTURE.md, "The capture/replay contract").
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
    """Named device buffers allocated once (``init_cuda_graph_state``); graph
    metadata fields are views of them, so their addresses never move."""

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
        """``LengthMetadata`` fields for ``bs`` requests of ``width`` query rows,
        as views of the buffers ``alloc_lengths`` made."""
        return dict(
            forward_mode=mode, bs=bs, max_q_len=width, num_tokens=bs * width,
            q_lens=self["q_lens"][:bs], kv_lens=self["kv_lens"][:bs],
            qo_indptr=self["qo_indptr"][: bs + 1], kv_indptr=self["kv_indptr"][: bs + 1],
            masked=masked,
        )  # fmt: skip

    def as_dict(self) -> Dict[str, torch.Tensor]:
        return dict(self._buffers)


class StaticGraphBackend(AttentionBackend):
    """The capture/replay contract as Pattern A (docs/ARCHITECTURE.md, "Pattern A and Pattern B"), for backends
    whose whole per-step state is tensors.

    * eager: ``_alloc_metadata(batch)`` (fresh tensors sized by the batch), then
      ``_fill_metadata``;
    * ``init_cuda_graph_state``: ``_alloc_graph_buffers`` once;
    * capture: ``_bind_metadata`` (views of the static buffers), stored per
      ``(mode, bs)``, then delegate to replay;
    * replay: look the stored metadata up and ``_fill_metadata`` it.

    Subclasses implement those four and ``forward_decode``/``forward_extend``,
    reading ``self.forward_metadata``.

    A bound fill on CUDA is recorded once per binding and replayed
    (``fill_graphs.py``) where ``fill_on_device`` says the fill is device
    work alone; a caller recording a whole step may hold it in its own
    graph instead (``fill_in_graph``). Where ``eager_steps_bound`` is set,
    an eager DECODE, EXTEND or MIXED step of up to ``max_bs`` requests fills
    a binding too, so it gets a replayed fill instead of fresh tensors.
    """

    supports_cuda_graph = True
    replay_reads_host_lengths = False  # key extents live on the device; FlashInfer's plan() reads its indptrs
    fill_on_device = True  # False where the fill also runs host work (FlashInfer's plan())
    eager_steps_bound = False

    def __init__(self, req_to_token_pool, kv_pool, num_q_heads: Optional[int] = None):
        super().__init__(req_to_token_pool, kv_pool, num_q_heads)
        self.forward_metadata: Optional[LengthMetadata] = None
        self._buffers: Optional[StaticBuffers] = None
        self._graph_metadata: Dict[Tuple[ForwardMode, int], LengthMetadata] = {}
        self._eager_metadata: Dict[Tuple[ForwardMode, int], LengthMetadata] = {}  # eager steps' own bindings
        self._fill_graphs: Dict[Tuple[str, ForwardMode, int], RecordedFill] = {}
        self._fill_recorder: Optional[FillRecorder] = None  # handed down by the graph layer
        # Bindings whose fill a caller's graph holds: the input addresses it reads (fill_in_graph).
        self._caller_graph_fills: Dict[Tuple[str, ForwardMode, int], Set[Tuple[int, int]]] = {}
        self.max_bs = 0
        self.max_num_tokens = 0

    # ---- the four steps a subclass provides ------------------------------
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
        """Write every runtime value of ``meta``; the one fill of all three
        paths. ``extend_lens`` None: every request has ``meta.max_q_len`` new
        tokens (a binding of a uniform mode)."""

    # ---- the contract ----------------------------------------------------
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
        """Static buffers for graphs of up to ``max_bs`` requests and
        ``max_num_tokens`` query rows.

        Captured graphs read these buffers' addresses for as long as they
        live, so a later call never moves or frees them: within the current
        sizes it changes nothing, and above them it adds a larger generation
        of buffers for the sizes captured from then on, while the metadata
        bound earlier keeps (and keeps alive) the buffers its graphs read.
        """
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
        # Pattern A: bind and store first, so replay (and any composite child's
        # replay) finds this batch size; then replay fills the runtime values.
        # A size captured before keeps its binding: graphs captured on it read
        # those views, and another runner's capture must not move them.
        key = (forward_mode, bs)
        if key not in self._graph_metadata:
            self._graph_metadata[key] = self._bind_metadata(bs, width, forward_mode, spec_info)
        self._check_bound(self._graph_metadata[key], bs, width, spec_info)
        # A new graph over these inputs: its caller says again whether it holds
        # the fill. Other runners' graphs of this size read other inputs and
        # keep what they said (two whole-model runners over one backend).
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
        # seq_lens_cpu may be None (capture passes None): it is never read here.
        meta = self._graph_metadata.get((forward_mode, bs))
        if meta is None:
            raise InvalidInputError(
                f"replay: expected a batch size captured for {forward_mode.name} "
                f"({sorted(b for m, b in self._graph_metadata if m == forward_mode)}), got {bs}; "
                f"call init_forward_metadata_capture_cuda_graph first"
            )
        width = self._check_graph_batch(bs, forward_mode, spec_info)
        self._check_bound(meta, bs, width, spec_info)
        # max_q_len / num_tokens were fixed at bind and no fill rewrites them,
        # so the constants baked into the graph cannot drift (the draft-extend
        # "restore max_seq_len_q after replay" exception upstream SGLang needed for draft extend (PR 26665) does
        # not arise). The capture's spec_info carries the real mask kind, so
        # tree-masked verify delegates to replay like every other mode.
        key = _graph_key(forward_mode, bs)
        if not self._filled_by_caller_graph(key, req_pool_indices, seq_lens):
            self._fill_bound(key, meta, _graph_inputs(bs, req_pool_indices, seq_lens), spec_info)
        self._begin_step(meta)
        self.forward_metadata = meta

    def fill_in_graph(self, forward_mode, bs, req_pool_indices, seq_lens) -> bool:
        """Let the caller's graph of ``(forward_mode, bs)`` hold this binding's
        metadata fill, so a replay launches nothing before the graph.

        The caller then calls the replay hook inside its recording (the
        fill is recorded with the model: it reads ``req_pool_indices`` and
        ``seq_lens``, the caller's static inputs) and before every replay as
        usual; a replay hook given exactly those tensors checks the step and
        leaves the device fill to the graph, which the caller must replay
        next. Given other tensors it fills as before. False (nothing
        changes) where the fill cannot be recorded: off CUDA, a tree mask,
        host work in the fill (``fill_on_device``), or no binding yet.
        """
        meta = self._graph_metadata.get((forward_mode, bs))
        if meta is None or not self.fill_on_device or not can_record_fill(seq_lens.device, meta.masked):
            return False
        addresses = _addresses(req_pool_indices, seq_lens)
        self._caller_graph_fills.setdefault(_graph_key(forward_mode, bs), set()).add(addresses)
        return True

    def _filled_by_caller_graph(self, key, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> bool:
        """Whether a caller's graph fills this binding from the first rows of
        exactly these tensors, by where they lie (``fill_in_graph``); never
        while capturing, when the fill is being recorded."""
        ptrs = self._caller_graph_fills.get(key)
        if ptrs is None or torch.cuda.is_current_stream_capturing():
            return False
        return _addresses(req_pool_indices, seq_lens) in ptrs

    def _begin_step(self, meta: LengthMetadata) -> None:
        """A binding serves step after step: drop the host state a subclass
        keeps on it for one step (the triton backend's launch plans)."""

    def _fill_bound(self, key, meta: LengthMetadata, inputs: Tuple[torch.Tensor, ...], spec_info) -> None:
        """Fill a binding from ``inputs``: ``(req_pool_indices, seq_lens)``,
        plus ``extend_lens`` for a ragged step (else every request has the
        binding's uniform width). Through its recorded fill where that is
        exact (``fill_graphs.py``), else with plain operations."""
        bs, mode = meta.bs, meta.forward_mode

        def fill(req_pool_indices, seq_lens, extend_lens=None) -> None:
            # extend_lens None: every request has the binding's uniform width.
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

    # ---- eager steps through a binding -------------------------------------
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
        """An eager step filled into the static buffers: for DECODE the graph
        binding of its size if one exists, else an eager binding (never
        offered to replay). Eager steps and replays run one at a time, and
        each rewrites what it reads.

        A ragged step's binding takes the step's query lengths as an input
        of its fill, and its host sizes (``max_q_len``, ``num_tokens``) from
        the batch: they size the launches, not the buffers.
        """
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
        """The step fits the graph bound for its ``(mode, bs)``: the query
        width and whether a tree mask is read were fixed at capture."""
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
        """The newest generation's buffers (``init_cuda_graph_state``)."""
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
    """The key of the graph binding of ``(forward_mode, bs)``'s fill."""
    return ("graph", forward_mode, bs)


def _graph_inputs(bs: int, req_pool_indices, seq_lens) -> tuple:
    """What the binding of ``bs`` requests fills from: the first ``bs`` rows of each."""
    return req_pool_indices[:bs], seq_lens[:bs]


def _addresses(req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> Tuple[int, int]:
    """Where a fill's two inputs lie: a caller's offer to hold the fill in
    its graph is kept by them (``fill_in_graph``). The first ``bs`` rows a
    binding fills from start where their tensors do, so the tensors' own
    addresses serve, with no slice taken before every replay."""
    return req_pool_indices.data_ptr(), seq_lens.data_ptr()


def can_record_fill(device: torch.device, masked: bool) -> bool:
    """Whether a bound fill on ``device`` may be recorded now: on CUDA, for
    fills that read nothing from the host but their input tensors (no tree
    mask: its flat length changes each step), and outside another capture
    (there the fill is recorded into the outer graph)."""
    return device.type == "cuda" and not masked and not torch.cuda.is_current_stream_capturing()
