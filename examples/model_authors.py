"""A model author's layer: plain PyTorch, attention through the custom op.

Run: python examples/model_authors.py
"""

import torch

import sgl_piecewise
from sgl_piecewise.backends import create_backend
from sgl_piecewise.engine.testing import random_batch


class Attention(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, layer_id: int):
        super().__init__()
        self.shape = (heads, kv_heads, head_dim)
        self.layer_id = layer_id
        self.qkv_proj = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim)
        self.o_proj = torch.nn.Linear(heads * head_dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden], all requests' tokens
        heads, kv_heads, head_dim = self.shape
        q, k, v = self.qkv_proj(x).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        o = sgl_piecewise.ops.unified_attention(  # q [T, Hq, D], k/v [T, Hkv, D] -> o [T, Hq, D]
            q.view(-1, heads, head_dim),
            k.view(-1, kv_heads, head_dim),
            v.view(-1, kv_heads, head_dim),
            layer_id=self.layer_id,
        )
        return self.o_proj(o.flatten(1))


# The paged KV cache, an attention backend, and one ragged step of 3 requests:
# 5, 2 and 9 tokens already cached, 3, 1 and 4 new tokens (8 rows in all).
table = sgl_piecewise.ReqToTokenPool(max_reqs=4, max_context_len=64)
pool = sgl_piecewise.KVPool(num_slots=256, num_layers=1, num_kv_heads=2, head_dim=16)
backend = create_backend("torch", table, pool)
batch = random_batch(sgl_piecewise.ForwardMode.EXTEND, table, pool, [5, 2, 9], [3, 1, 4])

layer = Attention(hidden=64, heads=4, kv_heads=2, head_dim=16, layer_id=0)
backend.init_forward_metadata(batch)
with torch.no_grad(), sgl_piecewise.forward_context(batch, backend):
    out = layer(torch.randn(batch.num_tokens, 64))
print(f"{batch.num_tokens} new tokens -> output {tuple(out.shape)}")
