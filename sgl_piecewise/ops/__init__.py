"""Custom ops (namespace ``sgl_piecewise``) for model authors: paged
attention, a decoder layer's fused projections, and linears of one input
as one matmul."""

from sgl_piecewise.ops.attention import unified_attention, unified_attention_with_output
from sgl_piecewise.ops.linear_stack import stacked_linear
from sgl_piecewise.ops.projections import gate_up_silu, linear, qkv_rope

__all__ = [
    "gate_up_silu",
    "linear",
    "qkv_rope",
    "stacked_linear",
    "unified_attention",
    "unified_attention_with_output",
]
