"""Regressions of drift bugs fixed upstream in SGLang, on every graph-capable
backend (docs/ARCHITECTURE.md, "Upstream drift bugs"):

* PR 26512 — DRAFT_EXTEND_V2 attends over prefix + new rows, the new rows
  being only in the cache;
* PR 26665 (and PR 22404, the same rule for the runner's inputs) — what capture
  writes equals what replay writes for the same batch;
* PR 26665 — a composite backend's capture hook works for never-replayed sizes,
  and replay never reads ``seq_lens_cpu`` (capture passes None);
* PR 25002 — V2's uniform query layout: ``cu_seqlens_q = [0, s, 2s, …]``,
  ``max_seq_len_q = s``; V1 stays ragged.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_backends_differential import (
    CASES,
    FLASHINFER_ON_GPU,
    GRAPH_CASES,
    MAX_BS,
    VERIFY_WIDTH,
    assert_close,
    attend,
    capture,
    draw_batch,
    eager,
    graph_backend,
    init_graph_state,
    make_backend,
    make_pools,
    pad_for_graph,
    pools_for,
    random_qkv,
    replay,
    tolerance_for,
)

from sgl_piecewise import ForwardMode, SpecInfo
from sgl_piecewise.backends import CompositeBackend, ReferenceBackend
from sgl_piecewise.engine.testing import random_batch

GRAPH_BACKENDS = ["torch", "triton", FLASHINFER_ON_GPU]
CASE = {c.id: c for c in CASES}


def _scale(pools) -> float:
    return pools.kv.head_dim**-0.5


def _prefix_only_attention(pools, batch, q, layer_id, scale):
    """What the PR 26512 bug computed: each request's queries over its ``seq_lens``
    keys (the prefix), missing the new rows already in the cache."""
    out = torch.empty_like(q)
    k_cache, v_cache = pools.kv.k_buffers[layer_id], pools.kv.v_buffers[layer_id]
    group = q.shape[1] // k_cache.shape[1]
    start = 0
    for row, prefix, new in zip(
        batch.req_pool_indices.tolist(), batch.seq_lens_cpu.tolist(), batch.extend_seq_lens_cpu
    ):
        slots = pools.req.req_to_token[row, :prefix].long()
        keys = k_cache[slots].repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, prefix, D]
        vals = v_cache[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        logits = q[start : start + new].transpose(0, 1) @ keys.transpose(1, 2) * scale
        out[start : start + new] = (logits.softmax(-1) @ vals).transpose(0, 1)
        start += new
    return out


# ---- DRAFT_EXTEND_V2 key extent (PR 26512) ------------------------------------
@pytest.mark.parametrize("name", GRAPH_BACKENDS)
def test_draft_extend_v2_replay_attends_to_new_rows_only_in_the_cache(name):
    rng = random.Random(f"pr26512-{name}")
    case = CASE["draft_extend_v2"]
    pools = pools_for(name)
    backend, ref = graph_backend(name, case.mode, pools), ReferenceBackend(pools.req, pools.kv)
    fill = backend.get_cuda_graph_seq_len_fill_value()
    capture(backend, pad_for_graph(draw_batch(pools, case, 2, rng), 4, fill))

    batch = draw_batch(pools, case, 4, rng)
    q, k, v = random_qkv(batch.num_tokens, pools, torch.Generator().manual_seed(2))[0]
    # The new rows go into the cache first (as the attention op does), and the
    # backend is handed zeros: whatever it attends, it must read from the cache.
    pools.kv.set_kv(0, batch.out_cache_loc, k, v)
    replay(backend, batch)
    assert torch.equal(backend.forward_metadata.kv_lens, batch.seq_lens + VERIFY_WIDTH)
    got, scale = torch.empty_like(q), _scale(pools)
    backend.forward(q, torch.zeros_like(k), torch.zeros_like(v), got, 0, batch, scale)
    want = torch.empty_like(q)
    ref.init_forward_metadata(batch)
    ref.forward(q, k, v, want, 0, batch, scale)
    assert_close([got], [want], tolerance_for(name))
    # The test can see the bug: prefix-only attention is far off (about 0.55 in PR 26512).
    bug = (_prefix_only_attention(pools, batch, q, 0, scale) - want).abs().max().item()
    assert bug > 0.1


@pytest.mark.parametrize("name", GRAPH_BACKENDS)
def test_eager_draft_extend_v2_key_extent_is_the_per_request_maximum(name):
    """Skewed ragged V2 step: ``max_seq_len_k = max_i(prefix_i + new_i) = 51``,
    not ``max(prefix) + max(new) = 54``; results still match the reference."""
    pools = pools_for(name)
    batch = random_batch(
        ForwardMode.DRAFT_EXTEND_V2, pools.req, pools.kv, [50, 2], [1, 4], spec_info=SpecInfo(num_tokens_per_req=4)
    )
    backend, ref = make_backend(name, pools), ReferenceBackend(pools.req, pools.kv)
    qkv = random_qkv(batch.num_tokens, pools, torch.Generator().manual_seed(3))
    assert_close(eager(backend, batch, qkv), eager(ref, batch, qkv), tolerance_for(name))
    meta = backend.forward_metadata
    assert meta.kv_lens.tolist() == [51, 6] and meta.kv_indptr.tolist() == [0, 51, 57]
    if name == "torch":
        assert meta.page_table.shape[1] == 51
    else:
        assert meta.kv_indices.shape[0] == 57


# ---- capture writes what replay writes (PR 26665, PR 22404) -------------------
@pytest.mark.parametrize("case", GRAPH_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("name", GRAPH_BACKENDS)
def test_capture_writes_exactly_what_replay_writes_for_the_same_batch(name, case):
    """Backend A captures batch X. Backend B captures another batch Y, then
    replays X. Every static buffer of A and B must be byte-equal."""
    rng = random.Random(f"pr26665-{name}-{case.id}")
    pools = pools_for(name)
    a, b = graph_backend(name, case.mode, pools), graph_backend(name, case.mode, pools)
    fill = a.get_cuda_graph_seq_len_fill_value()
    bs = 0 if case.mode.is_idle() else 3
    x = pad_for_graph(draw_batch(pools, case, bs, rng), 4, fill)
    y = pad_for_graph(draw_batch(pools, case, 0 if case.mode.is_idle() else 4, rng), 4, fill)
    capture(a, x)
    capture(b, y)
    replay(b, x, with_seq_lens_cpu=True)
    buffers_a, buffers_b = a.cuda_graph_buffers(), b.cuda_graph_buffers()
    assert buffers_a.keys() == buffers_b.keys() and buffers_a
    for key in buffers_a:
        assert torch.equal(buffers_a[key].view(torch.uint8), buffers_b[key].view(torch.uint8)), key
    ma, mb = a.forward_metadata, b.forward_metadata
    assert (ma.bs, ma.max_q_len, ma.num_tokens, ma.masked) == (mb.bs, mb.max_q_len, mb.num_tokens, mb.masked)


@pytest.mark.parametrize("name", GRAPH_BACKENDS)
def test_replay_never_reads_seq_lens_cpu(name):
    """Capture passes ``seq_lens_cpu=None``; replay with None or with the host
    lengths must write the same bytes (nothing compares it to the fill value)."""
    rng = random.Random(f"pr26665-cpu-{name}")
    case = CASE["verify_tree_mask"]
    pools = pools_for(name)
    a, b = graph_backend(name, case.mode, pools), graph_backend(name, case.mode, pools)
    batch = pad_for_graph(draw_batch(pools, case, 2, rng), 4, a.get_cuda_graph_seq_len_fill_value())
    for backend, host in ((a, False), (b, True)):
        capture(backend, batch)
        replay(backend, batch, with_seq_lens_cpu=host)
    for key, t in a.cuda_graph_buffers().items():
        assert torch.equal(t, b.cuda_graph_buffers()[key]), key


@pytest.mark.triton_cpu  # a triton child over CPU pools
@pytest.mark.parametrize("case", [CASE["decode"], CASE["verify_tree_mask"]], ids=lambda c: c.id)
def test_composite_capture_hook_works_for_sizes_never_replayed(case):
    rng = random.Random(f"pr26665-composite-{case.id}")
    pools = make_pools()
    primary = make_backend("torch", pools)
    children = [make_backend("torch", pools), make_backend("triton", pools)]
    composite = CompositeBackend(primary, children)
    init_graph_state(composite, case.mode)
    fill = composite.get_cuda_graph_seq_len_fill_value()
    sizes = [1, 2, 4, MAX_BS]
    batches = {bs: pad_for_graph(draw_batch(pools, case, bs, rng), bs, fill) for bs in sizes}
    for bs in sizes:  # capture only: no replay has run for any size (was KeyError: bs)
        capture(composite, batches[bs])
        for member in composite.members:
            assert member.forward_metadata.bs == bs
    ref = ReferenceBackend(pools.req, pools.kv)
    for bs in reversed(sizes):  # and every captured size replays
        replay(composite, batches[bs])
        qkv = random_qkv(batches[bs].num_tokens, pools, torch.Generator().manual_seed(bs))
        assert_close(attend(composite, batches[bs], qkv), eager(ref, batches[bs], qkv), 1e-4)


# ---- draft-extend query layout (PR 25002) -------------------------------------
@pytest.mark.parametrize("name", GRAPH_BACKENDS)
def test_draft_extend_v2_query_layout_is_uniform_in_capture_and_replay(name):
    rng = random.Random(f"pr25002-{name}")
    case, s, bs = CASE["draft_extend_v2"], VERIFY_WIDTH, 5
    pools = pools_for(name)
    backend = graph_backend(name, case.mode, pools)
    fill = backend.get_cuda_graph_seq_len_fill_value()
    uniform = [s * i for i in range(bs + 1)]  # cu_seqlens_q = [0, s, 2s, ...]
    capture(backend, pad_for_graph(draw_batch(pools, case, 3, rng), bs, fill))
    meta = backend.forward_metadata
    assert meta.qo_indptr.tolist() == uniform and meta.max_q_len == s
    replay(backend, pad_for_graph(draw_batch(pools, case, bs, rng), bs, fill))  # seq_lens_cpu=None
    assert backend.forward_metadata.qo_indptr.tolist() == uniform and backend.forward_metadata.max_q_len == s


@pytest.mark.parametrize("name", GRAPH_BACKENDS)
def test_draft_extend_v1_query_layout_stays_ragged(name):
    """V1 keeps ``cu_seqlens_q = cumsum(accept_lengths)`` (eager only: no V1 graph)."""
    rng = random.Random(f"pr25002-v1-{name}")
    pools = pools_for(name)
    batch = draw_batch(pools, CASE["draft_extend_v1"], 5, rng)
    backend = make_backend(name, pools)
    backend.init_forward_metadata(batch)
    accept = batch.spec_info.accept_lengths
    expected = torch.cat([torch.zeros(1, dtype=torch.int64), accept.long().cumsum(0)]).tolist()
    assert backend.forward_metadata.qo_indptr.tolist() == expected
    assert backend.forward_metadata.max_q_len == int(accept.max())
