"""Graph metadata shared by the graph-capable backends: the length fields every
kernel reads, the device-side fill helpers, and the Pattern A skeleton.

Why one module: SEEDS.md 000-002 are bugs where the eager path, the capture
hook and the replay hook each computed a length, a page table or an indptr
their own way. Here every path of every backend goes through the same three
steps — get a metadata object (fresh tensors when eager, views of static
buffers when graphed), fill it with the backend's one ``_fill_metadata``, make
it ``forward_metadata`` — and the fill helpers below are the only code that
writes lengths, indptrs and KV indices.

Every fill helper runs on the device with value-independent shapes: no
``.item()``, no ``.tolist()``, no boolean-mask indexing, so the replay path
never waits for the device and a fill may even be captured.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from sgl_piecewise.backends import lengths
from sgl_piecewise.backends.base import AttentionBackend
from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.errors import InvalidInputError, UnsupportedModeError
from sgl_piecewise.forward import ForwardBatch, ForwardMode, SpecInfo
from sgl_piecewise.memory import DUMMY_SLOT

# What the capture hook passes as ``seq_lens_sum`` when it delegates to replay:
# capture has no host copy of the lengths, and no backend here reads the sum
# on the replay path (key extents live on the device).
SEQ_LENS_SUM_UNKNOWN = -1


@dataclass
class LengthMetadata:
    """The fields every backend's kernels read, for ``bs`` requests.

    ``max_q_len`` and ``num_tokens`` are host ints: for graph modes they are
    the uniform width ``s`` (SEEDS.md 004) and ``bs * s``, constants baked into
    the captured kernels. ``masked``: the step reads a custom (tree) mask;
    for graphs this is fixed at capture.
    """

    forward_mode: ForwardMode
    bs: int
    max_q_len: int
    num_tokens: int
    q_lens: torch.Tensor  # [bs] int32, new tokens per request
    kv_lens: torch.Tensor  # [bs] int32, key extent (prefix + new), SEEDS.md 002
    qo_indptr: torch.Tensor  # [bs+1] int32, cu_seqlens_q
    kv_indptr: torch.Tensor  # [bs+1] int32, cu_seqlens_k
    masked: bool


def graph_query_width(mode: ForwardMode, spec_info: Optional[SpecInfo]) -> int:
    """Query rows per request in a graph step (SEEDS.md 004).

    DECODE: 1. TARGET_VERIFY and DRAFT_EXTEND_V2: ``spec_info.num_tokens_per_req``.
    IDLE: 1 — an idle graph is a decode graph whose requests are all padding.
    Ragged modes (EXTEND, MIXED, DRAFT_EXTEND v1) have no graph here.
    """
    if not mode.is_cuda_graph():
        raise UnsupportedModeError(
            f"graph capture: expected one of DECODE, TARGET_VERIFY, IDLE, DRAFT_EXTEND_V2, "
            f"got {mode.name}; ragged modes run eagerly (or piecewise, attention eager)"
        )
    if mode.is_idle():
        return 1
    num_tokens_per_req = spec_info.num_tokens_per_req if spec_info is not None else None
    return lengths.query_width(mode, num_tokens_per_req)


def host_lengths(batch: ForwardBatch) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q_lens, kv_lens)`` of an eager batch, int64 on the host: they size
    the eager metadata. The key extent comes from ``lengths.kv_lens`` as on
    the device (SEEDS.md 002)."""
    q_lens = torch.tensor(batch.extend_seq_lens_cpu, dtype=torch.int64)
    return q_lens, lengths.kv_lens(batch.forward_mode, batch.seq_lens_cpu.to(torch.int64), q_lens)


def has_custom_mask(spec_info: Optional[SpecInfo]) -> bool:
    return spec_info is not None and spec_info.custom_mask is not None


def fill_lengths(meta: LengthMetadata, seq_lens: torch.Tensor, extend_lens: torch.Tensor) -> None:
    """Write ``q_lens``, ``kv_lens`` and both indptrs from the step's lengths.

    ``seq_lens [bs]``: as in ``ForwardBatch`` (the prefix in TARGET_VERIFY and
    DRAFT_EXTEND_V2); ``extend_lens [bs]``: new tokens per request.
    """
    meta.q_lens.copy_(extend_lens)
    meta.kv_lens.copy_(lengths.kv_lens(meta.forward_mode, seq_lens.to(torch.int32), meta.q_lens))
    lengths.cumsum_with_zero(meta.q_lens, out=meta.qo_indptr)
    lengths.cumsum_with_zero(meta.kv_lens, out=meta.kv_indptr)


def request_of_position(indptr: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """For flat positions into a ragged layout with ``indptr [bs+1]``, the
    request each belongs to, ``[n]`` int64 in ``[0, bs-1]`` (positions past the
    end map to the last request; callers mask them)."""
    bs = indptr.shape[0] - 1
    req = torch.searchsorted(indptr[1:], positions.to(indptr.dtype), right=True)
    return req.clamp_(max=bs - 1)


def fill_kv_indices(
    kv_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
) -> None:
    """Flatten the page table: ``kv_indices[kv_indptr[b] + j] = req_to_token[row_b, j]``
    for ``j < kv_len_b``; every entry past ``kv_indptr[bs]`` is the dummy slot.

    ``kv_indices [N]`` (any N: the batch total when eager, the static maximum
    when graphed) is rewritten entirely, so nothing stale survives a replay.
    """
    bs = req_pool_indices.shape[0]
    n = kv_indices.shape[0]
    if bs == 0 or n == 0:
        kv_indices.fill_(DUMMY_SLOT)
        return
    pos = torch.arange(n, dtype=kv_indptr.dtype, device=kv_indices.device)
    req = request_of_position(kv_indptr, pos)
    col = (pos - kv_indptr[req]).clamp_(0, req_to_token.shape[1] - 1).long()
    slots = req_to_token[req_pool_indices.long()[req], col]
    kv_indices.copy_(torch.where(pos < kv_indptr[bs], slots, DUMMY_SLOT))


def fill_mask_indptr(mask_indptr: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor) -> None:
    """``mask_indptr [bs+1]``: offset of each request's ``[q_len, kv_len]`` block
    in the flat custom mask (``SpecInfo.custom_mask``)."""
    blocks = q_lens.to(mask_indptr.dtype) * kv_lens.to(mask_indptr.dtype)
    mask_indptr[:1].zero_()  # not `mask_indptr[0] = 0`: that copies a host scalar (a sync on CUDA)
    torch.cumsum(blocks, dim=0, out=mask_indptr[1:])


def copy_custom_mask(dst: torch.Tensor, custom_mask: torch.Tensor) -> None:
    """Copy the flat mask into ``dst``'s head and clear the tail, so the
    buffer's bytes depend on this step only (capture == replay, byte for byte)."""
    n = custom_mask.numel()
    if n > dst.numel():
        raise InvalidInputError(
            f"custom_mask: expected at most {dst.numel()} elements (the static buffer "
            f"from init_cuda_graph_state), got {n}; raise max_num_tokens or the context length"
        )
    dst[:n].copy_(custom_mask.reshape(-1))
    dst[n:].zero_()


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
    """The capture/replay contract as Pattern A (SEEDS.md 000), for backends
    whose whole per-step state is tensors.

    * eager: ``_alloc_metadata(batch)`` (fresh tensors sized by the batch), then
      ``_fill_metadata``;
    * ``init_cuda_graph_state``: ``_alloc_graph_buffers`` once;
    * capture: ``_bind_metadata`` (views of the static buffers), stored per
      ``(mode, bs)``, then delegate to replay;
    * replay: look the stored metadata up and ``_fill_metadata`` it.

    Subclasses implement those four and ``forward_decode``/``forward_extend``,
    reading ``self.forward_metadata``.
    """

    supports_cuda_graph = True

    def __init__(self, req_to_token_pool, kv_pool, num_q_heads: Optional[int] = None):
        super().__init__(req_to_token_pool, kv_pool, num_q_heads)
        self.forward_metadata: Optional[LengthMetadata] = None
        self._buffers: Optional[StaticBuffers] = None
        self._graph_metadata: Dict[Tuple[ForwardMode, int], LengthMetadata] = {}
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
        """Write every runtime value of ``meta``; the one fill of all three paths."""

    # ---- the contract ----------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.check_supported(batch.forward_mode)
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
                f"capture: expected num_tokens = bs * {width} = {bs * width} for "
                f"{forward_mode.name}, got {num_tokens}"
            )
        # Pattern A: bind and store first, so replay (and any composite child's
        # replay) finds this batch size; then replay fills the runtime values.
        # A size captured before keeps its binding: graphs captured on it read
        # those views, and another runner's capture must not move them.
        key = (forward_mode, bs)
        if key not in self._graph_metadata:
            self._graph_metadata[key] = self._bind_metadata(bs, width, forward_mode, spec_info)
        self._check_bound(self._graph_metadata[key], bs, width, spec_info)
        self.init_forward_metadata_replay_cuda_graph(
            bs, req_pool_indices, seq_lens, SEQ_LENS_SUM_UNKNOWN, encoder_lens,
            forward_mode, spec_info, seq_lens_cpu=None,
        )

    def init_forward_metadata_replay_cuda_graph(
        self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens, forward_mode, spec_info,
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
        # "restore max_seq_len_q after replay" exception of SEEDS.md 000 does
        # not arise). The capture's spec_info carries the real mask kind, so
        # tree-masked verify delegates to replay like every other mode.
        extend_lens = lengths.uniform_query_lens(bs, width, seq_lens.device)
        self._fill_metadata(
            meta, bs, req_pool_indices[:bs], seq_lens[:bs], extend_lens, forward_mode, spec_info
        )
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
