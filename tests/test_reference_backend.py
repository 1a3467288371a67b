"""The reference backend, the oracle of every other backend, against a direct
per-request computation on contiguous K/V (no pool, no page table)."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_piecewise import ForwardBatch, ForwardMode, KVPool, ReqToTokenPool, SpecInfo, forward_context
from sgl_piecewise.backends import ReferenceBackend
from sgl_piecewise.ops import unified_attention

HQ, HKV, D = 6, 2, 16


def direct_attention(q, keys, vals, causal_offset, mask=None):
    """softmax(q k^T / sqrt(D)) v for one request, float64, explicit loops over heads."""
    group = q.shape[1] // keys.shape[1]
    ql, kl = q.shape[0], keys.shape[0]
    if mask is None:
        mask = torch.arange(kl)[None, :] <= (torch.arange(ql)[:, None] + causal_offset)
    out = torch.empty(ql, q.shape[1], vals.shape[-1], dtype=torch.float64)
    for h in range(q.shape[1]):
        scores = q[:, h].double() @ keys[:, h // group].double().T / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~mask, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ vals[:, h // group].double()
    return out


def run_case(mode, prefix_lens, extend_lens, spec_info=None, layer_id=1):
    """Lay the requests out in a shuffled pool; return (output, expected)."""
    bs = len(prefix_lens)
    table = ReqToTokenPool(max_reqs=bs + 2, max_context_len=256)
    pool = KVPool(num_slots=1024, num_layers=3, num_kv_heads=HKV, head_dim=D)
    pool._free = pool._free[torch.randperm(pool._free.numel())]  # scattered slots
    rows = torch.tensor(table.alloc(bs))
    keys, vals, locs = [], [], []
    for row, p, e in zip(rows.tolist(), prefix_lens, extend_lens):
        slots = pool.alloc(p + e)
        table.write(row, 0, slots)
        k_all, v_all = torch.randn(p + e, HKV, D), torch.randn(p + e, HKV, D)
        pool.set_kv(layer_id, slots[:p], k_all[:p], v_all[:p])
        keys.append(k_all)
        vals.append(v_all)
        locs.append(slots[p:])
    T = sum(extend_lens)
    batch = ForwardBatch.build(
        mode, torch.zeros(T, dtype=torch.int64), rows, prefix_lens, extend_lens, torch.cat(locs), spec_info
    )
    backend = ReferenceBackend(table, pool)
    backend.init_forward_metadata(batch)
    q = torch.randn(T, HQ, D)
    k_new = torch.cat([k[p:] for k, p in zip(keys, prefix_lens)])
    v_new = torch.cat([v[p:] for v, p in zip(vals, prefix_lens)])
    with forward_context(batch, backend):
        out = unified_attention(q, k_new, v_new, layer_id=layer_id)
    expected, start, moff = [], 0, 0
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        mask = None
        if spec_info is not None and spec_info.custom_mask is not None:
            mask = spec_info.custom_mask[moff : moff + e * (p + e)].view(e, p + e)
            moff += e * (p + e)
        expected.append(direct_attention(q[start : start + e], keys[i], vals[i], p, mask))
        start += e
    return out, torch.cat(expected)


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=5),
    mode=st.sampled_from([ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND]),
)
def test_ragged_extend_matches_direct_attention(lens, mode):
    prefix, extend = [p for p, _ in lens], [e for _, e in lens]
    out, expected = run_case(mode, prefix, extend)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_decode_matches_direct_attention():
    out, expected = run_case(ForwardMode.DECODE, [0, 5, 63, 200], [1, 1, 1, 1])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2])
def test_prefix_held_modes_attend_over_prefix_plus_new_rows(mode):
    """upstream SGLang PR 26512: seq_lens holds the prefix; the new rows must still be seen."""
    s = 4
    out, expected = run_case(mode, [3, 50, 17], [s, s, s], SpecInfo(num_tokens_per_req=s))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_target_verify_tree_mask_is_applied():
    prefix, s = [5, 9], 3
    blocks = []
    for p in prefix:
        m = torch.ones(s, p + s, dtype=torch.bool)
        m[:, p:] = torch.rand(s, s) < 0.5
        m[:, p:] |= torch.eye(s, dtype=torch.bool)  # a draft token always sees itself
        blocks.append(m.flatten())
    spec = SpecInfo(num_tokens_per_req=s, custom_mask=torch.cat(blocks))
    out, expected = run_case(ForwardMode.TARGET_VERIFY, prefix, [s, s], spec)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_idle_batch_produces_an_empty_output():
    table = ReqToTokenPool(max_reqs=1, max_context_len=8)
    pool = KVPool(num_slots=8, num_layers=1, num_kv_heads=HKV, head_dim=D)
    empty = torch.empty(0, dtype=torch.int64)
    batch = ForwardBatch.build(ForwardMode.IDLE, empty, empty, [], [], empty)
    backend = ReferenceBackend(table, pool)
    backend.init_forward_metadata(batch)
    with forward_context(batch, backend):
        out = unified_attention(torch.empty(0, HQ, D), torch.empty(0, HKV, D), torch.empty(0, HKV, D), layer_id=0)
    assert out.shape == (0, HQ, D)


def test_sdpa_oracle_agrees_with_torch_sdpa_on_a_plain_causal_prompt():
    """The loop oracle above is itself checked against torch's SDPA once."""
    q, k, v = torch.randn(7, HQ, D), torch.randn(7, HKV, D), torch.randn(7, HKV, D)
    ours = direct_attention(q, k, v, 0)
    ref = F.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        k.double().repeat_interleave(3, 1).transpose(0, 1),
        v.double().repeat_interleave(3, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(ours, ref)
