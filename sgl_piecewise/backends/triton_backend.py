"""The Triton backend (``"triton"``): the split-KV decode kernel for DECODE,
the extend kernel for every other mode, over the paged pool (page size 1).
Metadata is filled in one launch (``fill_paged_metadata``); graphs bind it
to static buffers (Pattern A). Importing this module imports ``triton``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, NamedTuple, Optional

import torch

from sgl_piecewise.backends.base import BackendUnavailableError
from sgl_piecewise.backends.metadata import (
    LengthMetadata,
    copy_custom_mask,
    fill_mask_indptr,
    has_custom_mask,
    host_lengths,
)
from sgl_piecewise.backends.static_graph import StaticBuffers, StaticGraphBackend
from sgl_piecewise.backends.triton_kernels import (
    DEFAULT_MAX_KV_SPLITS,
    ExtendPlan,
    decode_attention,
    extend_attention,
    fill_paged_metadata,
    grid_kv_splits,
)
from sgl_piecewise.backends.triton_kernels.decode import INTERPRETED
from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.forward import ForwardBatch, ForwardMode


@dataclass
class TritonMetadata(LengthMetadata):
    mask_indptr: Optional[torch.Tensor]  # [bs+1] int64 block offsets in custom_mask
    kv_indices: torch.Tensor  # [N >= kv_indptr[bs]] int32 slots, request-major
    # Decode steps only:
    num_kv_splits: Optional[torch.Tensor]  # [bs] int32
    attn_logits: Optional[torch.Tensor]  # [bs, Hq, S, Dv] f32 scratch, S = grid splits of bs
    attn_lse: Optional[torch.Tensor]  # [bs, Hq, S] f32 scratch
    merge_counts: Optional[torch.Tensor]  # [bs, Hq] int32 split arrival counts, zero between launches
    custom_mask: Optional[torch.Tensor]  # [M] bool flat [q_len, kv_len] blocks (tree mask only)
    # The step's launches, built at its first layer; cleared by every fill.
    step_plan: Optional["StepPlan"] = None
    # Plans built over this metadata: a step of the same sizes reuses its last one.
    plans: Dict["PlanKey", Any] = field(default_factory=dict)


class PlanKey(NamedTuple):
    """What a plan was built for (a tuple underneath: compared at every layer)."""

    mode: ForwardMode
    num_tokens: int
    scale: float
    rows: int  # q's rows, padding included
    max_q_len: Optional[int]


class StepPlan(NamedTuple):
    """The plan a step's first layer built, and the slots it writes."""

    key: PlanKey
    out_cache_loc: torch.Tensor
    plan: Any  # a decode or extend plan: ``launch(q, k_cache, v_cache, out, k, v, layer_id)``


# Plans one binding keeps: decode needs one per logit scale; a ragged extend's sizes vary.
_MAX_PLANS = 8


def _is_decode_step(mode: ForwardMode) -> bool:
    # An idle graph is a decode graph of padding (metadata.graph_query_width).
    return mode.is_decode() or mode.is_idle()


def _check_kernels_can_run_on(device: torch.device) -> None:
    # Without the interpreter Triton fails deep in its driver lookup on CPU tensors.
    if device.type != "cpu" or INTERPRETED:
        return
    now = os.environ.get("TRITON_INTERPRET")
    raise BackendUnavailableError(
        f"triton backend over a {device.type} KV pool: expected TRITON_INTERPRET=1 set in the environment "
        f"before the Triton kernels are imported (or a CUDA device), got kernels imported without it "
        f"(TRITON_INTERPRET is {'unset' if now is None else repr(now)} now); set it before importing "
        f"sgl_piecewise, or put the pools on a CUDA device"
    )


class TritonBackend(StaticGraphBackend):
    """Triton kernels behind the capture/replay contract. ``max_kv_splits``:
    most key splits per decode request (only small batches reach it)."""

    name = "triton"
    eager_steps_bound = True  # any step's page table fits its binding

    def __init__(
        self,
        req_to_token_pool,
        kv_pool,
        num_q_heads: Optional[int] = None,
        *,
        max_kv_splits: int = DEFAULT_MAX_KV_SPLITS,
    ):
        super().__init__(req_to_token_pool, kv_pool, num_q_heads)
        _check_kernels_can_run_on(kv_pool.device)
        if not isinstance(num_q_heads, int) or num_q_heads <= 0 or num_q_heads % kv_pool.num_kv_heads:
            raise InvalidInputError(
                f"num_q_heads: expected a positive multiple of the pool's {kv_pool.num_kv_heads} "
                f"kv heads (it sizes the decode scratch), got {num_q_heads!r}"
            )
        self.max_kv_splits = check_positive_int("max_kv_splits", max_kv_splits)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        # One key per padded request: one split, one tile, no empty-range work.
        return 1

    def _alloc_metadata(self, batch: ForwardBatch) -> TritonMetadata:
        bs, mode, new = batch.batch_size, batch.forward_mode, self._new
        q_cpu, kv_cpu = host_lengths(batch)
        decode = _is_decode_step(mode)
        masked = has_custom_mask(batch.spec_info)
        hq, dv, splits = self.num_q_heads, self.kv_pool.head_dim, self._grid_splits(bs)
        return TritonMetadata(
            forward_mode=mode,
            bs=bs,
            max_q_len=int(q_cpu.max()) if bs else 0,
            num_tokens=batch.num_tokens,
            q_lens=new(bs),
            kv_lens=new(bs),
            qo_indptr=new(bs + 1),
            kv_indptr=new(bs + 1),
            masked=masked,
            mask_indptr=new(bs + 1, dtype=torch.int64) if masked else None,
            kv_indices=new(int(kv_cpu.sum())),
            num_kv_splits=new(bs) if decode else None,
            attn_logits=new(bs, hq, splits, dv, dtype=torch.float32) if decode else None,
            attn_lse=new(bs, hq, splits, dtype=torch.float32) if decode else None,
            merge_counts=torch.zeros(bs, hq, dtype=torch.int32, device=self.kv_pool.device) if decode else None,
            custom_mask=new(int((q_cpu * kv_cpu).sum()), dtype=torch.bool) if masked else None,
        )

    def _grid_splits(self, bs: int) -> int:
        pool = self.kv_pool
        return grid_kv_splits(
            bs, self.num_q_heads, pool.num_kv_heads, pool.dtype, self.max_kv_splits, pool.device, head_dim=pool.head_dim
        )

    def _alloc_graph_buffers(self, buffers: StaticBuffers, max_bs: int, max_num_tokens: int) -> None:
        context = self.req_to_token_pool.max_context_len
        hq, dv = self.num_q_heads, self.kv_pool.head_dim
        # Flat: each batch size views the front, so the scratch is the largest bs * S(bs).
        split_rows = max(bs * self._grid_splits(bs) for bs in range(1, max_bs + 1))
        buffers.alloc_lengths(max_bs)
        buffers.alloc("num_kv_splits", (max_bs,), torch.int32)
        buffers.alloc("mask_indptr", (max_bs + 1,), torch.int64)
        # Every request's keys fit in its req_to_token row: <= context each.
        buffers.alloc("kv_indices", (max_bs * context,), torch.int32)
        buffers.alloc("attn_logits", (split_rows * hq * dv,), torch.float32)
        buffers.alloc("attn_lse", (split_rows * hq,), torch.float32)
        buffers.alloc("merge_counts", (max_bs * hq,), torch.int32)  # every launch leaves them zero
        # One [context] row of mask per graph query row.
        buffers.alloc("custom_mask", (max_num_tokens * context,), torch.bool)

    def _bind_metadata(self, bs: int, width: int, mode: ForwardMode, spec_info) -> TritonMetadata:
        b = self._buffers
        decode = _is_decode_step(mode)
        masked = has_custom_mask(spec_info)
        hq, dv, splits = self.num_q_heads, self.kv_pool.head_dim, self._grid_splits(bs)
        context = self.req_to_token_pool.max_context_len
        return TritonMetadata(
            **b.length_views(bs, width, mode, masked),
            mask_indptr=b["mask_indptr"][: bs + 1] if masked else None,
            # bs rows of req_to_token hold the step's page table.
            kv_indices=b["kv_indices"][: bs * context],
            num_kv_splits=b["num_kv_splits"][:bs] if decode else None,
            attn_logits=b["attn_logits"][: bs * hq * splits * dv].view(bs, hq, splits, dv) if decode else None,
            attn_lse=b["attn_lse"][: bs * hq * splits].view(bs, hq, splits) if decode else None,
            merge_counts=b["merge_counts"][: bs * hq].view(bs, hq) if decode else None,
            custom_mask=b["custom_mask"] if masked else None,
        )

    def _fill_metadata(self, meta, bs, req_pool_indices, seq_lens, extend_lens, mode, spec_info) -> None:
        fill_paged_metadata(
            meta,
            meta.kv_indices,
            self.req_to_token_pool.req_to_token,
            req_pool_indices,
            seq_lens,
            extend_lens,
            meta.num_kv_splits,
            self.max_kv_splits,
        )
        if meta.masked:
            fill_mask_indptr(meta.mask_indptr, meta.q_lens, meta.kv_lens)
            copy_custom_mask(meta.custom_mask, spec_info.custom_mask)

    def _begin_step(self, meta: TritonMetadata) -> None:
        meta.step_plan = None

    def write_kv_and_attend(self, q, k, v, out, layer_id, batch, scale, num_tokens, out_cache_loc) -> bool:
        """One layer's K/V write and attention through the step's plan, built at its first layer."""
        mode = batch.forward_mode
        if mode.is_idle() or num_tokens == 0:  # nothing to write or attend: zero the rows
            return super().write_kv_and_attend(q, k, v, out, layer_id, batch, scale, num_tokens, out_cache_loc)
        meta = self.forward_metadata
        cached = meta.step_plan if meta is not None else None
        kc, vc = self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id]
        key = PlanKey(mode, num_tokens, scale, q.shape[0], meta.max_q_len if meta is not None else None)
        if cached is not None and cached.key == key and cached.out_cache_loc is out_cache_loc:
            if cached.plan.launch(q, kc, vc, out, k, v, layer_id):
                return True
        self.check_supported(mode)
        meta = self._current_metadata(q[:num_tokens], batch)
        plan = meta.plans.get(key)
        if plan is None or not (plan.rebind_slots(out_cache_loc) and plan.launch(q, kc, vc, out, k, v, layer_id)):
            plan = self._new_plan(q, k, v, out, kc, vc, meta, mode, scale, num_tokens, out_cache_loc)
            if len(meta.plans) >= _MAX_PLANS:  # a ragged step's sizes vary: keep the table small
                meta.plans.clear()
            meta.plans[key] = plan
        meta.step_plan = StepPlan(key, out_cache_loc, plan)
        return True

    def _new_plan(self, q, k, v, out, kc, vc, meta, mode, scale, num_tokens, out_cache_loc):
        """A plan checked and built for this step; its first launch done."""
        new_kv = dict(new_k=k, new_v=v, out_cache_loc=out_cache_loc, num_rows=num_tokens)
        if mode.is_decode():
            return self._decode(q, kc, vc, out, meta, scale, **new_kv)
        # A plain extend's new tokens are each request's last keys, in order: one launch.
        plan = ExtendPlan(
            q,
            kc,
            vc,
            out,
            meta.qo_indptr,
            meta.kv_indptr,
            meta.kv_indices,
            meta.max_q_len,
            scale,
            meta.custom_mask,
            meta.mask_indptr,
            **new_kv,
            fuse_kv_write=mode == ForwardMode.EXTEND,
        )
        plan.launch(q, kc, vc, out, k, v)
        return plan

    def layer_attend(self) -> Optional["_LayerAttend"]:
        meta = self.forward_metadata
        entry = meta.step_plan if meta is not None else None
        return None if entry is None else _LayerAttend(self, meta, entry)

    def forward_decode(self, q, k, v, out, layer_id, batch, scale) -> None:
        meta = self._current_metadata(q, batch)
        self._decode(q, self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id], out, meta, scale)

    def _decode(self, q, k_cache, v_cache, out, meta, scale, **new_kv):
        return decode_attention(
            q,
            k_cache,
            v_cache,
            out,
            meta.kv_indptr,
            meta.kv_indices,
            meta.attn_logits,
            meta.attn_lse,
            meta.merge_counts,
            meta.num_kv_splits,
            self.max_kv_splits,
            scale,
            **new_kv,
        )

    def forward_extend(self, q, k, v, out, layer_id, batch, scale) -> None:
        meta = self._current_metadata(q, batch)
        extend_attention(
            q,
            self.kv_pool.k_buffers[layer_id],
            self.kv_pool.v_buffers[layer_id],
            out,
            meta.qo_indptr,
            meta.kv_indptr,
            meta.kv_indices,
            meta.max_q_len,
            scale,
            custom_mask=meta.custom_mask,
            mask_indptr=meta.mask_indptr,
        )


class _LayerAttend:
    """A later layer through the plan its step's first layer built, while the
    backend holds it; compares the scale, layer and tensors only (False:
    take the full path)."""

    __slots__ = ("backend", "meta", "entry", "plan", "scale", "k_buffers", "v_buffers")

    def __init__(self, backend: TritonBackend, meta: TritonMetadata, entry: StepPlan):
        self.backend, self.meta, self.entry, self.plan = backend, meta, entry, entry.plan
        self.scale = entry.key.scale
        self.k_buffers, self.v_buffers = backend.kv_pool.k_buffers, backend.kv_pool.v_buffers

    def __call__(self, q, k, v, out, layer_id, scale: float) -> bool:
        if self.backend.forward_metadata is not self.meta or self.meta.step_plan is not self.entry:
            return False
        if scale != self.scale:
            return False
        if type(layer_id) is not int or not 0 <= layer_id < len(self.k_buffers):
            return False
        return self.plan.launch(q, self.k_buffers[layer_id], self.v_buffers[layer_id], out, k, v, layer_id)
