"""The reference backend, the oracle: pure PyTorch, one request at a time,
float32 and an explicit mask into SDPA; obviously right, not fast. It reads
host-side lengths, so it cannot run inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F

from sgl_piecewise.backends import lengths
from sgl_piecewise.backends.base import AttentionBackend
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.forward import ForwardBatch


@dataclass
class ReferenceMetadata:
    q_starts: List[int]
    q_lens: List[int]
    kv_lens: List[int]
    req_rows: List[int]
    # Offset of each request's [q_len, kv_len] block in spec_info.custom_mask.
    mask_offsets: Optional[List[int]]


class ReferenceBackend(AttentionBackend):
    name = "reference"
    supports_cuda_graph = False

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        q_lens = list(batch.extend_seq_lens_cpu)
        kv = lengths.kv_lens(
            batch.forward_mode,
            batch.seq_lens_cpu.to(torch.int64),
            torch.tensor(q_lens, dtype=torch.int64),
        ).tolist()
        starts = [0]
        for n in q_lens[:-1]:
            starts.append(starts[-1] + n)
        mask_offsets = None
        spec = batch.spec_info
        if spec is not None and spec.custom_mask is not None:
            mask_offsets = [0]
            for ql, kl in zip(q_lens[:-1], kv[:-1]):
                mask_offsets.append(mask_offsets[-1] + ql * kl)
            expected = sum(ql * kl for ql, kl in zip(q_lens, kv))
            if spec.custom_mask.numel() != expected:
                raise InvalidInputError(
                    f"custom_mask: expected {expected} elements (sum of q_len*kv_len), got {spec.custom_mask.numel()}"
                )
        self.metadata = ReferenceMetadata(
            q_starts=starts,
            q_lens=q_lens,
            kv_lens=[int(x) for x in kv],
            req_rows=batch.req_pool_indices.tolist(),
            mask_offsets=mask_offsets,
        )
        self._custom_mask = spec.custom_mask if mask_offsets is not None else None

    def forward_decode(self, q, k, v, out, layer_id, batch, scale) -> None:
        self._attend(q, out, layer_id, scale)

    def forward_extend(self, q, k, v, out, layer_id, batch, scale) -> None:
        self._attend(q, out, layer_id, scale)

    def _attend(self, q: torch.Tensor, out: torch.Tensor, layer_id: int, scale: float) -> None:
        m = self.metadata
        k_cache = self.kv_pool.k_buffers[layer_id]
        v_cache = self.kv_pool.v_buffers[layer_id]
        table = self.req_to_token_pool.req_to_token
        group = q.shape[1] // k_cache.shape[1]
        for r, (start, ql, kl, row) in enumerate(zip(m.q_starts, m.q_lens, m.kv_lens, m.req_rows)):
            if ql == 0:
                continue
            slots = table[row, :kl].long()
            keys = k_cache[slots].float().repeat_interleave(group, dim=1)  # [kl, Hq, D]
            vals = v_cache[slots].float().repeat_interleave(group, dim=1)
            allowed = self._mask(r, ql, kl, q.device)
            o = F.scaled_dot_product_attention(
                q[start : start + ql].float().transpose(0, 1),  # [Hq, ql, D]
                keys.transpose(0, 1),
                vals.transpose(0, 1),
                attn_mask=allowed,
                scale=scale,
            )
            out[start : start + ql] = o.transpose(0, 1).to(out.dtype)

    def _mask(self, r: int, ql: int, kl: int, device: torch.device) -> torch.Tensor:
        """[ql, kl] bool: the tree mask if given, else causal at offset kl - ql."""
        if self._custom_mask is not None:
            off = self.metadata.mask_offsets[r]
            return self._custom_mask[off : off + ql * kl].view(ql, kl).to(device, torch.bool)
        rows = torch.arange(ql, device=device).unsqueeze(1) + (kl - ql)
        return torch.arange(kl, device=device).unsqueeze(0) <= rows
