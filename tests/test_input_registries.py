"""The runners' registries (upstream SGLang PRs 22404 and 26742): the shared buffer pool, the
one count of real tokens (num_token_non_padded) and the decode and prefill
factories, filled from real ``ForwardBatch`` es.

Every fill draws fresh random data; "tail" is rows ``[raw, padded)``.
"""

import pytest
import torch
from test_buffer_registry import I32, I64, MAX_BS, MAX_TOKENS, P, _decode_sources, bad, decode_, rand, reg_, slot_

from sgl_piecewise.engine.testing import place_requests
from sgl_piecewise.forward import ForwardBatch, ForwardMode, SpecInfo
from sgl_piecewise.graphs.buffer_registry import FillContext
from sgl_piecewise.graphs.input_registries import (
    SharedBufferPool,
    build_decode_registry,
    build_prefill_registry,
    compute_local_num_token_non_padded,
    num_token_non_padded_for,
)
from sgl_piecewise.memory import DUMMY_SLOT, KVPool, ReqToTokenPool


# ---- shared pool -------------------------------------------------------------
def test_pool_aliases_identical_requests_and_keeps_differing_ones_apart():
    pool = SharedBufferPool()
    a = pool.share_input_buffer("seq_lens", 8, I32, "cpu")
    others = [("positions", 8, I32), ("seq_lens", 9, I32), ("seq_lens", 8, I64)]
    ptrs = {pool.share_input_buffer(n, k, d, "cpu").data_ptr() for n, k, d in others}
    assert pool.share_input_buffer("seq_lens", 8, I32, torch.device("cpu")) is a
    assert len(pool) == 4 and len(ptrs | {a.data_ptr()}) == 4


@pytest.mark.parametrize("decode_first", [True, False])
def test_registries_sharing_a_pool_alias_same_spec_slots_whatever_the_order(decode_first):
    pool = SharedBufferPool()
    build = [
        lambda: build_decode_registry(4, "cpu", seq_len_fill_value=1, pool=pool),
        lambda: build_prefill_registry(4, 4, "cpu", seq_len_fill_value=1, pool=pool),
    ]
    dec, pre = (build[0](), build[1]()) if decode_first else reversed([build[1](), build[0]()])
    for name in dec.names:  # same name, numel, dtype, device -> same memory
        assert dec.get_slot(name).buffer.data_ptr() == pre.get_slot(name).buffer.data_ptr()
    assert "extend_prefix_lens" not in dec and len(pool) == len(pre)


def test_fill_once_constants_are_never_pooled():
    pool = SharedBufferPool()
    a = slot_(reg_(pool=pool), policy=P.FILL_ONCE, pad_value=1, copy_from_fb=False)
    b = slot_(reg_(pool=pool), policy=P.FILL_ONCE, pad_value=2, copy_from_fb=False)
    assert a.buffer.data_ptr() != b.buffer.data_ptr() and len(pool) == 0


# ---- num_token_non_padded (upstream SGLang PR 22404) -------------------------------------
@pytest.mark.parametrize(
    "global_num, per_dp, tp, rank, local",
    [
        (5, 8, 1, 0, 5),  # no attention TP: the identity
        (5, 8, 2, 0, 4),  # 4 rows per rank: rank 0 holds rows 0-3, all real
        (5, 8, 2, 1, 1),  # rank 1 holds rows 4-7, only row 4 real
        (3, 8, 4, 2, 0),  # rank 2 holds rows 4-5: none real
        (8, 8, 4, 3, 2),  # full batch: every rank holds 2 real rows
    ],
)
def test_local_num_token_non_padded(global_num, per_dp, tp, rank, local):
    assert compute_local_num_token_non_padded(global_num, per_dp, tp, rank) == local
    as_tensor = compute_local_num_token_non_padded(torch.tensor(global_num), per_dp, tp, rank)
    assert int(as_tensor) == local


def test_local_num_token_non_padded_rejects_a_split_that_loses_rows():
    with bad("expected a multiple of attn_tp_size=2, got 7"):
        compute_local_num_token_non_padded(5, 7, 2, 0)
    with bad(r"attn_tp_rank: expected an int in \[0, 2\), got 2"):
        compute_local_num_token_non_padded(5, 8, 2, 2)


# ---- factories ---------------------------------------------------------------
def _table(reg):
    return {s.name: (s.axis, s.padding_policy, s.pad_value, s.dtype, s.buffer.shape) for s in reg}


def test_decode_registry_declares_its_slots():
    reg = decode_(4, fill=2, num_tokens_per_bs=3, with_accept_lengths=True)
    S = P.FILL_SENTINEL
    assert _table(reg) == {
        "input_ids": ("tokens", P.FOREACH_COPY, 0, I64, (12,)),  # 4 requests x 3 tokens
        "positions": ("tokens", P.ZERO, 0, I64, (12,)),
        "out_cache_loc": ("tokens", S, DUMMY_SLOT, I64, (12,)),
        "num_token_non_padded": ("none", P.KEEP_PAD, 0, I32, ()),
        "seq_lens": ("bs", S, 2, I32, (4,)),
        "seq_lens_cpu": ("bs", S, 2, I32, (4,)),
        "req_pool_indices": ("bs", P.ZERO, 0, I64, (4,)),
        "extend_seq_lens": ("bs", S, 3, I32, (4,)),
        "accept_lengths": ("bs", S, 3, I32, (4,)),
    }
    assert reg.get_slot("num_token_non_padded").copy_from_fb is False


def test_decode_registry_without_host_lengths_has_no_host_slot_and_refuses_to_bind_one():
    reg = decode_(host_seq_lens=False)
    assert "seq_lens_cpu" not in reg and "seq_lens" in reg
    with bad(r"bind: expected names among .* got \['seq_lens_cpu'\]"):
        decode_(host_seq_lens=False, bind={"seq_lens_cpu": torch.zeros(MAX_BS, dtype=I32)})


def _real_batch(mode, prefix, extend, spec_info=None):
    req_pool, kv_pool = ReqToTokenPool(16, 64), KVPool(256, 1, 1, 4)
    rows_, loc = place_requests(req_pool, kv_pool, prefix, extend)
    ids = torch.randint(0, 100, (sum(extend),))
    return ForwardBatch.build(mode, ids, rows_, list(prefix), list(extend), loc, spec_info)


def test_decode_fill_from_a_forward_batch_gives_the_padded_views():
    batch = _real_batch(ForwardMode.DECODE, torch.randint(1, 20, (3,)).tolist(), [1, 1, 1])
    reg = decode_()
    old_ids = rand(MAX_BS)
    reg.get_slot("input_ids").buffer.copy_(old_ids)  # an earlier step's ids
    ctx = FillContext.uniform(3, 4)
    reg.fill_from(batch, ctx)
    v = reg.extract(ctx)
    pad = lambda t, x: torch.cat([t.to(I64), torch.tensor([x])])  # noqa: E731
    assert torch.equal(v["input_ids"], pad(batch.input_ids, int(old_ids[3])))
    assert torch.equal(v["positions"], pad(batch.positions, 0))
    assert torch.equal(v["out_cache_loc"], pad(batch.out_cache_loc, DUMMY_SLOT))
    assert torch.equal(v["seq_lens"].long(), pad(batch.seq_lens, 1))
    assert torch.equal(v["seq_lens_cpu"].long(), pad(batch.seq_lens_cpu, 1))
    assert torch.equal(v["req_pool_indices"], pad(batch.req_pool_indices, 0))
    assert v["extend_seq_lens"].tolist() == [1, 1, 1, 1] and int(v["num_token_non_padded"]) == 3


@pytest.mark.parametrize("tp, rank", [(1, 0), (2, 0), (2, 1)])
def test_capture_and_replay_write_the_same_num_token_non_padded(tp, rank):
    reg = decode_(attn_tp_size=tp, attn_tp_rank=rank)
    ctx = FillContext.uniform(3, 4)
    reg.fill_from(_decode_sources(3), ctx)  # capture: dummy inputs of these sizes
    captured = int(reg.get_slot("num_token_non_padded").buffer)
    reg.fill_from(_real_batch(ForwardMode.DECODE, [4, 2, 7], [1, 1, 1]), ctx)  # replay
    replayed = int(reg.get_slot("num_token_non_padded").buffer)
    assert captured == replayed == num_token_non_padded_for(ctx, tp, rank)
    assert replayed == compute_local_num_token_non_padded(3, 4, tp, rank)


def test_decode_target_verify_pads_requests_to_the_draft_width():
    spec = SpecInfo(num_tokens_per_req=2)
    batch = _real_batch(ForwardMode.TARGET_VERIFY, [5, 3], [2, 2], spec)
    reg = decode_(4, num_tokens_per_bs=2)
    ctx = FillContext.uniform(2, 3, tokens_per_req=2)
    reg.fill_from(batch, ctx)
    v = reg.extract(ctx)
    assert v["seq_lens"].tolist() == [5, 3, 1]  # TARGET_VERIFY: seq_lens is the prefix
    assert v["extend_seq_lens"].tolist() == [2, 2, 2]
    assert v["out_cache_loc"][4:].tolist() == [DUMMY_SLOT] * 2
    assert v["positions"][4:].tolist() == [0, 0]
    assert int(v["num_token_non_padded"]) == 4


def test_decode_accept_lengths_are_padded_to_the_width_and_absent_spec_is_all_padding():
    reg = decode_(4, num_tokens_per_bs=3, with_accept_lengths=True)
    ctx = FillContext.uniform(2, 3, tokens_per_req=3)
    spec = SpecInfo(num_tokens_per_req=3, accept_lengths=torch.tensor([1, 2], dtype=I32))
    reg.fill_from(_real_batch(ForwardMode.DRAFT_EXTEND_V2, [4, 6], [3, 3], spec), ctx)
    assert reg.extract(ctx)["accept_lengths"].tolist() == [1, 2, 3]
    reg.fill_from(_real_batch(ForwardMode.DRAFT_EXTEND_V2, [4, 6], [3, 3]), ctx)  # spec_info None
    assert reg.extract(ctx)["accept_lengths"].tolist() == [3, 3, 3]


def test_prefill_registry_declares_its_slots():
    reg = build_prefill_registry(32, 4, "cpu", seq_len_fill_value=1)
    table = _table(reg)
    assert {n: t[:3] for n, t in table.items() if t[0] == "tokens"} == {
        "input_ids": ("tokens", P.FOREACH_COPY, 0),
        "positions": ("tokens", P.ZERO, 0),
        "out_cache_loc": ("tokens", P.FILL_SENTINEL, DUMMY_SLOT),
    }
    assert table["extend_seq_lens"][:3] == ("bs", P.ZERO, 0)
    assert table["extend_prefix_lens"][:3] == ("bs", P.FILL_SENTINEL, 1)
    assert set(table) == set(_decode_sources(1)) | {"num_token_non_padded", "extend_prefix_lens"}
    assert table["input_ids"][4] == (32,) and table["seq_lens"][4] == (4,)


def test_prefill_fill_from_an_extend_batch_gives_the_padded_views():
    batch = _real_batch(ForwardMode.EXTEND, [0, 4], [5, 3])
    reg = build_prefill_registry(MAX_TOKENS, MAX_BS, "cpu", seq_len_fill_value=1)
    ctx = FillContext(raw_bs=2, padded_bs=3, raw_num_tokens=8, padded_num_tokens=12)
    reg.fill_from(batch, ctx)
    v = reg.extract(ctx)
    assert torch.equal(v["input_ids"][:8], batch.input_ids)
    assert torch.equal(v["positions"][:8], batch.positions)
    assert v["positions"][8:].tolist() == [0] * 4
    assert v["out_cache_loc"][8:].tolist() == [DUMMY_SLOT] * 4
    assert v["seq_lens"].tolist() == [5, 7, 1] and v["extend_seq_lens"].tolist() == [5, 3, 0]
    # prefix + new == seq_lens for the padded request too
    assert (v["extend_prefix_lens"] + v["extend_seq_lens"]).tolist() == v["seq_lens"].tolist()
    assert int(v["num_token_non_padded"]) == 8


def test_factory_bind_adopts_named_buffers_and_rejects_unknown_names():
    mine = torch.zeros(MAX_BS, dtype=I32)
    reg = decode_(bind={"seq_lens": mine})
    assert reg.get_slot("seq_lens").buffer is mine
    with bad(r"bind: expected names among .* got \['seq_len'\]"):
        decode_(bind={"seq_len": mine})
