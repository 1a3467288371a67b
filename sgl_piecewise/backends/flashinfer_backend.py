"""The FlashInfer backend (``"flashinfer"``): FlashInfer's paged decode
(DECODE) and prefill (every other mode) wrappers over the pool, page size 1.

Graphs follow Pattern B (docs/ARCHITECTURE.md, "Pattern A and Pattern B"):
:meth:`FlashInferBackend._create_wrappers` makes the eager wrappers and, at
capture, one per ``(mode, bs)`` over the static buffers. Replay fills the
buffers and calls ``plan()`` on the host; the graph holds ``run()``.
Importing this module does not import ``flashinfer``; constructing the
backend does.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sgl_piecewise.backends.base import BackendUnavailableError
from sgl_piecewise.backends.metadata import (
    LengthMetadata,
    copy_custom_mask,
    has_custom_mask,
    host_lengths,
)
from sgl_piecewise.backends.static_graph import StaticBuffers, StaticGraphBackend
from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.forward import ForwardBatch, ForwardMode

# FlashInfer's documented recommendation for the float workspace.
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024
# FA2 serves custom masks (verify trees), which FA3 does not: one family for every mode.
PREFILL_KERNELS = "fa2"
PAGE_SIZE = 1  # req_to_token maps one token to one slot
# Head sizes FlashInfer ships prebuilt; others fail inside its dispatch, so they are refused here.
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def import_flashinfer() -> Any:
    """``import flashinfer``, or raise naming the extra that installs it."""
    try:
        return importlib.import_module("flashinfer")
    except ImportError as exc:
        raise BackendUnavailableError(
            f"flashinfer backend: expected the flashinfer package, got ImportError ({exc}); "
            f"install it with `pip install sgl_piecewise[gpu]`, or use the torch or triton backend"
        ) from exc


@dataclass
class FlashInferMetadata(LengthMetadata):
    kv_indices: torch.Tensor  # [N >= kv_indptr[bs]] int32 slots (= pages)
    last_page_len: torch.Tensor  # [bs] int32, all 1: every page holds one token
    custom_mask: Optional[torch.Tensor]  # [M] bool flat [q_len, kv_len] blocks
    # Graph mode with a mask: the static buffer plan() packs the mask into.
    packed_mask: Optional[torch.Tensor]
    wrapper: Any  # the decode or prefill wrapper that plans and runs this step
    step: Optional["_FlashInferStep"] = None  # built by the step's first layer


def _is_decode_step(mode: ForwardMode) -> bool:
    return mode.is_decode() or mode.is_idle()


class FlashInferBackend(StaticGraphBackend):
    """FlashInfer kernels behind the capture/replay contract (CUDA, fp16/bf16
    pools). ``workspace_bytes``: the float workspace all wrappers share."""

    name = "flashinfer"
    fill_on_device = False  # the fill ends in plan(), host work
    prepares_ahead = False  # plan() rewrites pinned host buffers a queued copy may still read

    def __init__(
        self,
        req_to_token_pool,
        kv_pool,
        num_q_heads: Optional[int] = None,
        *,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    ):
        super().__init__(req_to_token_pool, kv_pool, num_q_heads)
        self._flashinfer = import_flashinfer()
        # Imported here: importing the backends loads no Triton.
        from sgl_piecewise.backends.triton_kernels.metadata_fill import fill_paged_metadata

        self._fill_paged = fill_paged_metadata
        self._pages = [_paged(k, v) for k, v in zip(kv_pool.k_buffers, kv_pool.v_buffers)]  # see _paged_cache
        if kv_pool.device.type != "cuda":
            raise InvalidInputError(
                f"flashinfer backend: expected a KV pool on a CUDA device, got {kv_pool.device}; "
                f"use the torch or triton backend on this device"
            )
        if not isinstance(num_q_heads, int) or num_q_heads <= 0 or num_q_heads % kv_pool.num_kv_heads:
            raise InvalidInputError(
                f"num_q_heads: expected a positive multiple of the pool's {kv_pool.num_kv_heads} "
                f"kv heads (plan() needs it), got {num_q_heads!r}"
            )
        if kv_pool.head_dim not in SUPPORTED_HEAD_DIMS:
            raise InvalidInputError(
                f"flashinfer backend: expected head_dim in {SUPPORTED_HEAD_DIMS}, got "
                f"{kv_pool.head_dim}; use the triton or torch backend for this model"
            )
        check_positive_int("workspace_bytes", workspace_bytes)
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=kv_pool.device)
        # From a group of 4 up, the tensor-core decode path (SGLang's choice).
        self._decode_tensor_cores = num_q_heads // kv_pool.num_kv_heads >= 4
        # plan() fixes the softmax scale; layers with another scale rescale q.
        self._plan_scale = 1.0 / math.sqrt(kv_pool.head_dim)
        self._eager_decode = self._create_wrappers(decode=True, views=None)
        self._eager_prefill = self._create_wrappers(decode=False, views=None)

    def _create_wrappers(self, decode: bool, views: Optional[FlashInferMetadata]) -> Any:
        """The one place wrappers are made: eager (``views=None``) or over ``views``' fixed buffers."""
        fi = self._flashinfer
        if decode:
            graph = (
                {}
                if views is None
                else dict(
                    use_cuda_graph=True,
                    paged_kv_indptr_buffer=views.kv_indptr,
                    paged_kv_indices_buffer=views.kv_indices,
                    paged_kv_last_page_len_buffer=views.last_page_len,
                )
            )
            kernels = PREFILL_KERNELS if self._decode_tensor_cores else "auto"
            return fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=self._decode_tensor_cores, backend=kernels, **graph
            )
        graph = (
            {}
            if views is None
            else dict(
                use_cuda_graph=True,
                qo_indptr_buf=views.qo_indptr,
                paged_kv_indptr_buf=views.kv_indptr,
                paged_kv_indices_buf=views.kv_indices,
                paged_kv_last_page_len_buf=views.last_page_len,
                # FlashInfer packs our bool mask into these at plan() time.
                custom_mask_buf=views.packed_mask,
                mask_indptr_buf=self._buffers["packed_mask_indptr"][: views.bs + 1] if views.masked else None,
            )
        )
        return fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend=PREFILL_KERNELS, **graph)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        # plan() needs >= 1 page per request (last_page_len is 1, not 0).
        return 1

    def _alloc_metadata(self, batch: ForwardBatch) -> FlashInferMetadata:
        bs, mode, new = batch.batch_size, batch.forward_mode, self._new
        q_cpu, kv_cpu = host_lengths(batch)
        masked = has_custom_mask(batch.spec_info)
        return FlashInferMetadata(
            forward_mode=mode,
            bs=bs,
            max_q_len=int(q_cpu.max()) if bs else 0,
            num_tokens=batch.num_tokens,
            q_lens=new(bs),
            kv_lens=new(bs),
            qo_indptr=new(bs + 1),
            kv_indptr=new(bs + 1),
            masked=masked,  # FlashInfer derives the mask offsets from the indptrs
            kv_indices=new(int(kv_cpu.sum())),
            last_page_len=new(bs),
            custom_mask=new(int((q_cpu * kv_cpu).sum()), dtype=torch.bool) if masked else None,
            packed_mask=None,  # eager: plan() packs into FlashInfer's own buffer
            wrapper=self._eager_decode if _is_decode_step(mode) else self._eager_prefill,
        )

    def _alloc_graph_buffers(self, buffers: StaticBuffers, max_bs: int, max_num_tokens: int) -> None:
        context = self.req_to_token_pool.max_context_len
        buffers.alloc_lengths(max_bs)
        buffers.alloc("last_page_len", (max_bs,), torch.int32)
        buffers.alloc("packed_mask_indptr", (max_bs + 1,), torch.int32)
        buffers.alloc("kv_indices", (max_bs * context,), torch.int32)
        buffers.alloc("custom_mask", (max_num_tokens * context,), torch.bool)
        # Bit-packed per request: ceil(q_len * kv_len / 8) bytes each.
        buffers.alloc("packed_mask", (max_num_tokens * context // 8 + max_bs,), torch.uint8)

    def _bind_metadata(self, bs: int, width: int, mode: ForwardMode, spec_info) -> FlashInferMetadata:
        b = self._buffers
        masked = has_custom_mask(spec_info)
        views = FlashInferMetadata(
            **b.length_views(bs, width, mode, masked),
            kv_indices=b["kv_indices"],
            last_page_len=b["last_page_len"][:bs],
            custom_mask=b["custom_mask"] if masked else None,
            packed_mask=b["packed_mask"] if masked else None,
            wrapper=None,
        )
        views.wrapper = self._create_wrappers(_is_decode_step(mode), views)
        return views

    def _fill_metadata(self, meta, bs, req_pool_indices, seq_lens, extend_lens, mode, spec_info) -> None:
        self._fill_paged(
            meta, meta.kv_indices, self.req_to_token_pool.req_to_token, req_pool_indices, seq_lens, extend_lens
        )
        meta.last_page_len.fill_(PAGE_SIZE)
        if meta.masked:
            copy_custom_mask(meta.custom_mask, spec_info.custom_mask)
        if meta.packed_mask is not None:
            # plan() writes only this step's bytes: clear the rest (capture == replay).
            meta.packed_mask.zero_()
        if bs:
            self._plan(meta)

    def _plan(self, meta: FlashInferMetadata) -> None:
        """Host-side scheduling (reads the indptrs back): never inside a graph."""
        pool = self.kv_pool
        common = dict(q_data_type=pool.dtype, kv_data_type=pool.dtype, sm_scale=self._plan_scale)
        heads = (self.num_q_heads, pool.num_kv_heads, pool.head_dim, PAGE_SIZE)
        if _is_decode_step(meta.forward_mode):
            meta.wrapper.plan(meta.kv_indptr, meta.kv_indices, meta.last_page_len, *heads, **common)
            return
        meta.wrapper.plan(
            meta.qo_indptr,
            meta.kv_indptr,
            meta.kv_indices,
            meta.last_page_len,
            *heads,
            custom_mask=meta.custom_mask,
            causal=not meta.masked,
            **common,
        )

    def _begin_step(self, meta: FlashInferMetadata) -> None:
        meta.step = None

    def write_kv_and_attend(self, q, k, v, out, layer_id, batch, scale, num_tokens, out_cache_loc) -> bool:
        """The step's first layer builds its plan and attends through it."""
        mode = batch.forward_mode
        if mode.is_idle() or num_tokens == 0:  # nothing to write or attend: zero the rows
            return super().write_kv_and_attend(q, k, v, out, layer_id, batch, scale, num_tokens, out_cache_loc)
        self.check_supported(mode)
        meta = self._current_metadata(q[:num_tokens], batch)
        meta.step = _FlashInferStep(self, meta, q, k, v, out, layer_id, scale, num_tokens, out_cache_loc)
        if meta.step(q, k, v, out, layer_id, scale):  # built from these very tensors: it takes them
            return True
        return super().write_kv_and_attend(q, k, v, out, layer_id, batch, scale, num_tokens, out_cache_loc)

    def layer_attend(self) -> Optional["_FlashInferStep"]:
        meta = self.forward_metadata
        return None if meta is None else meta.step

    def forward_decode(self, q, k, v, out, layer_id, batch, scale) -> None:
        self._run(q, out, layer_id, batch, scale)

    def forward_extend(self, q, k, v, out, layer_id, batch, scale) -> None:
        self._run(q, out, layer_id, batch, scale)

    def _run(self, q, out, layer_id, batch, scale) -> None:
        meta = self._current_metadata(q, batch)
        if scale != self._plan_scale:
            q = q * (scale / self._plan_scale)
        meta.wrapper.run(q, self._paged_cache(layer_id), out=out)

    def _paged_cache(self, layer_id: int) -> tuple:
        """Layer ``layer_id``'s pool as FlashInfer's paged cache (views kept until the buffers change)."""
        k, v = self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id]
        pages = self._pages[layer_id]
        if pages[0]._base is not k or pages[1]._base is not v:
            pages = self._pages[layer_id] = _paged(k, v)
        return pages


def _paged(k: torch.Tensor, v: torch.Tensor) -> tuple:
    """A ``[slots, Hkv, D]`` pool as ``[pages, 1, Hkv, D]`` (NHD)."""
    return k.unsqueeze(1), v.unsqueeze(1)


class _FlashInferStep:
    """One step's attention between compiled pieces, fixed at its first
    layer: the checks and the ``store_kv`` launch. For a later layer it
    compares only what can differ between layers; False, launching nothing,
    sends the op down the full path."""

    __slots__ = (
        "backend",
        "meta",
        "scale",
        "q_factor",
        "layout_of",
        "layout",
        "store",
        "num_tokens",
        "padded",
        "k_buffers",
        "v_buffers",
    )

    def __init__(
        self,
        backend: FlashInferBackend,
        meta: FlashInferMetadata,
        q,
        k,
        v,
        out,
        layer_id: int,
        scale: float,
        num_tokens: int,
        out_cache_loc: torch.Tensor,
    ):
        # Imported here: importing the backends loads no Triton.
        from sgl_piecewise.backends.triton_kernels.store_kv import launch_store_kv, store_kv_args, store_kv_meta
        from sgl_piecewise.backends.triton_kernels.tiles import check_last_dim_contiguous, check_new_kv, layer_layout
        from sgl_piecewise.internals.triton_launch import StepLaunch

        pool = backend.kv_pool
        kc, vc = pool.k_buffers[layer_id], pool.v_buffers[layer_id]
        rows = q.shape[0]
        check_new_kv("flashinfer backend", rows, num_tokens, kc, vc, k, v, out_cache_loc)
        check_last_dim_contiguous("flashinfer backend", k=k, v=v, out=out)
        self.backend, self.meta, self.scale = backend, meta, scale
        # plan() fixed the softmax scale; a layer with another one rescales q.
        self.q_factor = None if scale == backend._plan_scale else scale / backend._plan_scale
        self.layout_of = layer_layout
        self.layout = layer_layout(q, kc, vc, out, k, v)
        store_meta = store_kv_meta(kc.shape[1], q.shape[1], kc.shape[2], vc.shape[2])
        args = store_kv_args(k, v, kc, vc, out_cache_loc, out, num_tokens)
        self.store = StepLaunch(launch_store_kv, (rows,), args, store_meta, layer_positions=(0, 1, 2, 3, 5))
        self.num_tokens, self.padded = num_tokens, rows > num_tokens
        self.k_buffers, self.v_buffers = pool.k_buffers, pool.v_buffers

    def __call__(self, q, k, v, out, layer_id, scale: float) -> bool:
        if self.backend.forward_metadata is not self.meta or self.meta.step is not self or scale != self.scale:
            return False
        if type(layer_id) is not int or not 0 <= layer_id < len(self.k_buffers):
            return False
        kc, vc = self.k_buffers[layer_id], self.v_buffers[layer_id]
        if self.layout_of(q, kc, vc, out, k, v) != self.layout:
            return False
        self.store.launch(k, v, kc, vc, out, layer=layer_id)
        if self.padded:
            q, out = q[: self.num_tokens], out[: self.num_tokens]
        if self.q_factor is not None:
            q = q * self.q_factor
        self.meta.wrapper.run(q, self.backend._paged_cache(layer_id), out=out)
        return True
