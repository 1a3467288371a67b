"""A composite backend: every metadata hook runs on a primary and its
children, in order, so any member can attend any layer of the step (a
hybrid model's ``layer_routes``). Each member's capture binds its own
per-``bs`` metadata before its replay, so a never-replayed size works.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence

import torch

from sgl_piecewise.backends.base import AttentionBackend
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.forward import ForwardBatch


class CompositeBackend(AttentionBackend):
    """``primary`` + ``children`` over the same pools. ``primary`` attends every
    layer not in ``layer_routes`` (``{layer_id: child index}``) and gives the
    fill value."""

    name = "composite"

    def __init__(
        self,
        primary: AttentionBackend,
        children: Sequence[AttentionBackend],
        layer_routes: Optional[Mapping[int, int]] = None,
    ):
        super().__init__(primary.req_to_token_pool, primary.kv_pool, primary.num_q_heads)
        self.primary = primary
        self.children = list(children)
        self.members = [primary, *self.children]
        self.layer_routes = dict(layer_routes or {})
        self._check_members()
        self.supported_modes = frozenset.intersection(*(frozenset(m.supported_modes) for m in self.members))
        self.supports_cuda_graph = all(m.supports_cuda_graph for m in self.members)
        self.replay_reads_host_lengths = any(m.replay_reads_host_lengths for m in self.members)
        self.prepares_ahead = all(m.prepares_ahead for m in self.members)

    def _check_members(self) -> None:
        for i, child in enumerate(self.children):
            if child.kv_pool is not self.kv_pool or child.req_to_token_pool is not self.req_to_token_pool:
                raise InvalidInputError(
                    f"children[{i}]: expected the primary's KV and request pools, got other pools; "
                    f"the attention op writes K/V through the primary's pool"
                )
        fills = {m.name: m.get_cuda_graph_seq_len_fill_value() for m in self.members}
        if len(set(fills.values())) > 1:
            raise InvalidInputError(f"composite: expected one seq_lens fill value for padded requests, got {fills}")
        for layer, child in self.layer_routes.items():
            if not isinstance(layer, int) or not isinstance(child, int) or not 0 <= child < len(self.children):
                raise InvalidInputError(
                    f"layer_routes: expected {{layer_id: child index in [0, {len(self.children)})}}, "
                    f"got {layer!r}: {child!r}"
                )

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        for member in self.members:
            member.prepare_metadata(batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        for member in self.members:
            member.init_cuda_graph_state(max_bs, max_num_tokens)

    def use_fill_recorder(self, recorder) -> None:
        for member in self.members:
            member.use_fill_recorder(recorder)

    def reserve_eager_bindings(self, max_bs: int, max_num_tokens: int) -> None:
        for member in self.members:
            member.reserve_eager_bindings(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(
        self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens, forward_mode, spec_info
    ) -> None:
        for member in self.members:
            member.init_forward_metadata_capture_cuda_graph(
                bs, num_tokens, req_pool_indices, seq_lens, encoder_lens, forward_mode, spec_info
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
        for member in self.members:
            member.init_forward_metadata_replay_cuda_graph(
                bs,
                req_pool_indices,
                seq_lens,
                seq_lens_sum,
                encoder_lens,
                forward_mode,
                spec_info,
                seq_lens_cpu,
            )

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.primary.get_cuda_graph_seq_len_fill_value()

    def cuda_graph_buffers(self) -> Dict[str, torch.Tensor]:
        buffers = {}
        for i, member in enumerate(self.members):
            prefix = "primary" if i == 0 else f"children[{i - 1}]"
            buffers.update({f"{prefix}.{name}": t for name, t in member.cuda_graph_buffers().items()})
        return buffers

    def member_for_layer(self, layer_id: int) -> AttentionBackend:
        child = self.layer_routes.get(layer_id)
        return self.primary if child is None else self.children[child]

    def forward_decode(self, q, k, v, out, layer_id, batch, scale) -> None:
        self.member_for_layer(layer_id).forward_decode(q, k, v, out, layer_id, batch, scale)

    def forward_extend(self, q, k, v, out, layer_id, batch, scale) -> None:
        self.member_for_layer(layer_id).forward_extend(q, k, v, out, layer_id, batch, scale)
