"""Custom ops (``torch.library``, namespace ``sgl_piecewise``) for model
authors: attention over the paged KV cache, and a decoder layer's
projections fused with their neighbours."""

from sgl_piecewise.ops.attention import unified_attention, unified_attention_with_output
from sgl_piecewise.ops.projections import gate_up_silu, linear, qkv_rope

__all__ = ["gate_up_silu", "linear", "qkv_rope", "unified_attention", "unified_attention_with_output"]
