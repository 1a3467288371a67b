"""What differs between the modes a whole-model graph serves, so
``CudaGraphRunner`` has one capture and one replay path: each mode's width
(new tokens per request), static batch, ``spec_info`` for the backend's
hooks, and why a batch cannot replay. The table: docs/ARCHITECTURE.md,
"CudaGraphRunner"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from sgl_piecewise.errors import InvalidInputError, InvalidTypeError
from sgl_piecewise.forward import ForwardBatch, ForwardMode, SpecInfo

GRAPH_MODES = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2, ForwardMode.IDLE)
LABELS = {
    ForwardMode.DECODE: "decode",
    ForwardMode.TARGET_VERIFY: "verify",
    ForwardMode.DRAFT_EXTEND_V2: "draft-extend",
    ForwardMode.IDLE: "idle",
}


@dataclass(frozen=True)
class ModeLayout:
    """One mode's graph layout; ``masked``: TARGET_VERIFY graphs read a tree mask."""

    mode: ForwardMode
    width: int
    masked: bool = False

    @property
    def label(self) -> str:
        return LABELS[self.mode]

    @property
    def speculative(self) -> bool:
        """``seq_lens`` holds the prefix, and ``spec_info`` the width."""
        return self.mode.seq_lens_exclude_new_tokens()


def mode_layouts(
    modes: Sequence[ForwardMode], num_tokens_per_req: Optional[int], tree_mask: bool
) -> Dict[ForwardMode, ModeLayout]:
    """The layouts of ``modes``, checked."""
    if isinstance(modes, (str, ForwardMode)) or not isinstance(modes, Sequence) or not modes:
        raise InvalidTypeError(f"modes: expected a non-empty sequence of ForwardMode, got {modes!r}")
    bad = [m for m in modes if not isinstance(m, ForwardMode) or m not in GRAPH_MODES]
    if bad or len(set(modes)) != len(modes):
        raise InvalidInputError(
            f"modes: expected distinct modes among {[m.name for m in GRAPH_MODES]}, got {list(modes)}"
        )
    speculative = [m for m in modes if m.seq_lens_exclude_new_tokens()]
    if speculative and (
        isinstance(num_tokens_per_req, bool) or not isinstance(num_tokens_per_req, int) or num_tokens_per_req < 1
    ):
        raise InvalidInputError(
            f"num_tokens_per_req: expected an int >= 1 for {[m.name for m in speculative]} "
            f"(tokens per request), got {num_tokens_per_req!r}"
        )
    if not speculative and num_tokens_per_req is not None:
        raise InvalidInputError(
            f"num_tokens_per_req: expected None without TARGET_VERIFY or DRAFT_EXTEND_V2 among the modes, "
            f"got {num_tokens_per_req!r}"
        )
    if tree_mask and ForwardMode.TARGET_VERIFY not in modes:
        raise InvalidInputError("tree_mask: expected TARGET_VERIFY among the modes, got tree_mask=True without it")
    return {
        m: ModeLayout(m, num_tokens_per_req if m in speculative else 1, tree_mask and m.is_target_verify())
        for m in modes
    }


def static_batch(layout: ModeLayout, views: Dict[str, torch.Tensor], bs: int) -> ForwardBatch:
    """The batch a graph of ``bs`` requests reads: the registry's views, and the
    host lists every replay of this size has (IDLE: all padding)."""
    w = layout.width
    return ForwardBatch(
        forward_mode=layout.mode,
        batch_size=bs,
        input_ids=views["input_ids"],
        positions=views["positions"],
        seq_lens=views["seq_lens"],
        seq_lens_cpu=views.get("seq_lens_cpu"),  # None fails loudly where a stale copy would not
        extend_seq_lens=views["extend_seq_lens"],
        extend_prefix_lens=torch.empty_like(views["seq_lens"]),
        req_pool_indices=views["req_pool_indices"],
        out_cache_loc=views["out_cache_loc"],
        extend_seq_lens_cpu=[0 if layout.mode.is_idle() else w] * bs,
        extend_prefix_lens_cpu=[],
        num_token_non_padded=views["num_token_non_padded"],
        spec_info=_static_spec(layout, views),
    )


def _static_spec(layout: ModeLayout, views: Dict[str, torch.Tensor]) -> Optional[SpecInfo]:
    """The width and, in DRAFT_EXTEND_V2, the registry's accept lengths; the tree
    mask goes to the hooks per step."""
    if not layout.speculative:
        return None
    return SpecInfo(num_tokens_per_req=layout.width, accept_lengths=views.get("accept_lengths"))


def refresh_prefix_lens(static: ForwardBatch) -> None:
    """``extend_prefix_lens`` of the static batch from its ``seq_lens``."""
    if static.forward_mode.seq_lens_exclude_new_tokens():
        static.extend_prefix_lens.copy_(static.seq_lens)
    else:
        torch.sub(static.seq_lens, static.extend_seq_lens, out=static.extend_prefix_lens)


def why_eager(layout: ModeLayout, batch: ForwardBatch) -> Optional[str]:
    """Why ``batch`` cannot replay a graph of this layout (sizes aside), or None."""
    if not layout.speculative:
        return None
    spec = batch.spec_info
    width = spec.num_tokens_per_req if spec is not None else None
    if width != layout.width:
        return f"{layout.label} graphs: {width} tokens per request, captured {layout.width}"
    if any(n != width for n in batch.extend_seq_lens_cpu):
        return f"{layout.label} graphs: a ragged batch, captured a uniform {width} tokens per request"
    if layout.masked != (spec.custom_mask is not None):
        want = "a" if layout.masked else "no"
        return f"{layout.label} graphs: captured with {want} tree mask, got the other kind"
    return None


def causal_block(prefix: int, width: int, device) -> torch.Tensor:
    """``[width, prefix + width]`` bool, flat: a chain's causal mask over its prefix."""
    i = torch.arange(width, device=device).view(width, 1)
    j = torch.arange(prefix + width, device=device).view(1, prefix + width)
    return (j <= prefix + i).flatten()


def graph_spec(
    layout: ModeLayout, batch: Optional[ForwardBatch], raw_bs: int, padded_bs: int, fill: int, device
) -> Optional[SpecInfo]:
    """``spec_info`` for the backend's hooks at ``padded_bs`` (``batch`` None: a
    capture); a tree mask gets a causal block per padded request."""
    if not layout.speculative:
        return None
    mask = None
    if layout.masked:
        pad = causal_block(fill, layout.width, device).repeat(padded_bs - raw_bs)
        mask = pad if batch is None else torch.cat([batch.spec_info.custom_mask.reshape(-1).to(device), pad])
    return SpecInfo(num_tokens_per_req=layout.width, custom_mask=mask)
