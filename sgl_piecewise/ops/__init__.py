"""Custom ops (``torch.library``, namespace ``sgl_piecewise``) for model authors."""

from sgl_piecewise.ops.attention import unified_attention, unified_attention_with_output

__all__ = ["unified_attention", "unified_attention_with_output"]
