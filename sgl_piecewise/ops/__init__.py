"""Custom ops (namespace ``sgl_piecewise``) for model authors: paged
attention and a decoder layer's fused projections."""

from sgl_piecewise.ops.attention import unified_attention, unified_attention_with_output
from sgl_piecewise.ops.projections import gate_up_silu, linear, qkv_rope

__all__ = ["gate_up_silu", "linear", "qkv_rope", "unified_attention", "unified_attention_with_output"]
