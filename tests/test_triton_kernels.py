"""Our Triton decode/extend attention kernels against a float64 torch oracle.

Every case draws a fresh ragged batch over a shuffled paged layout (slot ids
are a random permutation, slot 0 stays the dummy), poisons ``out`` with NaN
and checks that every row is written and matches. On a CPU the kernels run
under TRITON_INTERPRET=1 (set by conftest.py); tests marked ``gpu`` repeat
the checks at model-like sizes in bf16 on CUDA, including graph replay.
"""

from __future__ import annotations

import gc
import random
import weakref
from dataclasses import dataclass
from typing import List

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from sgl_piecewise.backends.triton_kernels import (  # noqa: E402
    DecodeLaunch,
    ExtendPlan,
    choose_num_kv_splits,
    decode_attention,
    extend_attention,
    grid_kv_splits,
)
from sgl_piecewise.backends.triton_kernels import decode as dec  # noqa: E402
from sgl_piecewise.errors import InvalidInputError  # noqa: E402

CPU = torch.device("cpu")
# Relative/absolute tolerances per input dtype. bf16 outputs carry 8 mantissa
# bits, so a rounding error of 2**-8 of the largest |value| is expected.
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@dataclass
class PagedBatch:
    """A ragged batch over a shuffled paged pool.

    q: ``[T, Hq, D]``; k_cache/v_cache: ``[num_slots + 1, Hkv, D|Dv]``;
    qo_indptr/kv_indptr: ``[bs + 1]`` int32; kv_indices: ``[sum kv_lens + slack]``.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    q_lens: List[int]
    kv_lens: List[int]


def _indptr(lens: List[int], device) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    return out.to(device)


def make_batch(
    q_lens,
    kv_lens,
    num_q_heads,
    num_kv_heads,
    head_dim,
    dtype,
    device=CPU,
    dv=None,
    index_dtype=torch.int32,
    q_padded_heads=0,
) -> PagedBatch:
    """Random batch; ``q_padded_heads`` > 0 makes q a strided view (as from a fused qkv)."""
    dv = dv or head_dim
    total_kv = sum(kv_lens)
    num_slots = total_kv + 7  # spare slots: indices need not cover the pool
    k_cache = torch.randn(num_slots + 1, num_kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn(num_slots + 1, num_kv_heads, dv, device=device).to(dtype)
    slots = torch.randperm(num_slots, device=device)[:total_kv] + 1
    # Trailing junk past kv_indptr[bs]: callers pass oversized static buffers.
    kv_indices = torch.cat([slots, torch.zeros(5, dtype=slots.dtype, device=device)]).to(index_dtype)
    t = sum(q_lens)
    q_full = torch.randn(t, num_q_heads + q_padded_heads, head_dim, device=device).to(dtype)
    return PagedBatch(
        q=q_full[:, :num_q_heads],
        k_cache=k_cache,
        v_cache=v_cache,
        qo_indptr=_indptr(q_lens, device),
        kv_indptr=_indptr(kv_lens, device),
        kv_indices=kv_indices,
        q_lens=list(q_lens),
        kv_lens=list(kv_lens),
    )


def causal_visible(q_len: int, kv_len: int, device=CPU) -> torch.Tensor:
    """``[q_len, kv_len]``: row i sees keys j <= kv_len - q_len + i."""
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return torch.arange(kv_len, device=device)[None, :] <= rows


def tree_visible(q_len: int, kv_len: int, rng: random.Random) -> torch.Tensor:
    """Speculative-decoding tree mask: all prefix keys, plus each draft token's
    ancestors and itself among the new ones."""
    prefix = kv_len - q_len
    vis = torch.zeros(q_len, kv_len, dtype=torch.bool)
    vis[:, :prefix] = True
    for i in range(q_len):
        vis[i, prefix + i] = True
        if i > 0:
            parent = rng.randrange(i)
            vis[i, prefix : prefix + i] = vis[parent, prefix : prefix + i]
    return vis


def reference(b: PagedBatch, scale: float, visible: List[torch.Tensor]) -> torch.Tensor:
    """float64 attention per request; rows with no visible key are zeros."""
    group = b.q.shape[1] // b.k_cache.shape[1]
    outs = []
    for r, (ql, kl) in enumerate(zip(b.q_lens, b.kv_lens)):
        q0, k0 = int(b.qo_indptr[r]), int(b.kv_indptr[r])
        slots = b.kv_indices[k0 : k0 + kl].long()
        k = b.k_cache[slots].double().repeat_interleave(group, dim=1)
        v = b.v_cache[slots].double().repeat_interleave(group, dim=1)
        s = torch.einsum("ihd,jhd->hij", b.q[q0 : q0 + ql].double(), k) * scale
        s = s.masked_fill(~visible[r].to(s.device)[None], float("-inf"))
        p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
        outs.append(torch.einsum("hij,jhd->ihd", p, v))
    return torch.cat(outs)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), "some output rows were never written"
    tol = TOL[dtype]
    err = (out.double() - ref).abs().max().item()
    bound = tol * max(1.0, ref.abs().max().item())
    assert err <= bound, f"max abs error {err:.3e} > {bound:.3e}"


# ---------------------------------------------------------------- decode


def run_decode(b: PagedBatch, max_kv_splits: int, num_splits: torch.Tensor, launch=None) -> torch.Tensor:
    bs, num_q_heads = b.q.shape[0], b.q.shape[1]
    dv = b.v_cache.shape[2]
    out = torch.full((bs, num_q_heads, dv), float("nan"), dtype=b.q.dtype, device=b.q.device)
    # Scratch with stale NaNs: unused splits must never be read.
    logits = torch.full((bs + 2, num_q_heads, max_kv_splits + 1, dv), float("nan"), device=b.q.device)
    lse = torch.full((bs + 2, num_q_heads, max_kv_splits + 1), float("nan"), device=b.q.device)
    counts = torch.zeros(bs, num_q_heads, dtype=torch.int32, device=b.q.device)
    decode_attention(
        b.q,
        b.k_cache,
        b.v_cache,
        out,
        b.kv_indptr,
        b.kv_indices,
        logits,
        lse,
        counts,
        num_splits,
        max_kv_splits,
        b.q.shape[2] ** -0.5,
        launch,
    )
    return out


def decode_reference(b: PagedBatch) -> torch.Tensor:
    return reference(b, b.q.shape[2] ** -0.5, [torch.ones(1, n, dtype=torch.bool) for n in b.kv_lens])


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (8, 2), (14, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_reference_across_gqa_and_lengths(num_q_heads, num_kv_heads, dtype):
    # Lengths 0 (zeros out), 1, short, and long enough for several splits.
    kv_lens = [0, 1, 33, random.Random(num_q_heads).randint(200, 300)]
    b = make_batch([1] * 4, kv_lens, num_q_heads, num_kv_heads, 64, dtype)
    splits = torch.empty(4, dtype=torch.int32)
    choose_num_kv_splits(torch.tensor(kv_lens), 4, splits, tokens_per_split=64)
    assert splits.tolist() == [1, 1, 1, 4]
    assert_close(run_decode(b, 4, splits), decode_reference(b), dtype)


def test_decode_zero_length_request_outputs_zeros_not_nan():
    b = make_batch([1, 1], [0, 5], 4, 2, 32, torch.float32)
    out = run_decode(b, 2, torch.tensor([2, 2], dtype=torch.int32))
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_decode_split_whose_keys_all_have_minus_inf_logits_weighs_nothing():
    # Keys 0-31 (the first of 4 splits) get logit -inf for the heads of kv
    # head 0: that split has weight sum 0 and must drop out of the merge, not
    # turn the request into 0/0 = NaN.
    b = make_batch([1], [100], 4, 2, 32, torch.float32)
    b.k_cache[b.kv_indices[:32].long(), 0, 0] = float("inf")
    b.q[0, :2, 0] = -1.0
    out = run_decode(b, 4, torch.tensor([4], dtype=torch.int32))
    assert_close(out, decode_reference(b), torch.float32)


@pytest.mark.parametrize("head_dim,dv", [(80, 80), (128, 64), (16, 16)])
def test_decode_handles_non_power_of_two_and_distinct_value_dims(head_dim, dv):
    kv_lens = [7, 70, 130]
    b = make_batch([1] * 3, kv_lens, 4, 1, head_dim, torch.float32, dv=dv)
    splits = torch.tensor([3, 2, 3], dtype=torch.int32)
    assert_close(run_decode(b, 3, splits), decode_reference(b), torch.float32)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(48, 2), (80, 1)])
def test_decode_wide_groups_split_heads_across_programs(num_q_heads, num_kv_heads):
    # 16-bit inputs widen the head tile: group 24 fits one 32-row tile, group
    # 80 needs two 64-row tiles, the second only partly filled.
    kv_lens = [3, 45]
    b = make_batch([1, 1], kv_lens, num_q_heads, num_kv_heads, 16, torch.bfloat16)
    splits = torch.tensor([1, 2], dtype=torch.int32)
    assert_close(run_decode(b, 2, splits), decode_reference(b), torch.bfloat16)


def test_decode_any_split_count_gives_the_same_answer():
    # Arbitrary per-request splits, including more splits than 32-key granules
    # (empty splits) and out-of-range counts (clamped to [1, max]).
    kv_lens = [1, 40, 95, 160]
    b = make_batch([1] * 4, kv_lens, 8, 2, 64, torch.float32, index_dtype=torch.int64, q_padded_heads=4)
    ref = decode_reference(b)
    for splits in ([1, 1, 1, 1], [5, 5, 5, 5], [0, 2, 4, 9], [3, 1, 5, 2]):
        out = run_decode(b, 5, torch.tensor(splits, dtype=torch.int32))
        assert_close(out, ref, torch.float32)


def test_decode_merges_more_splits_than_one_merge_chunk():
    # The merge loads merge_block_s splits at a time (8 here): 9 and 20 splits
    # take two and three chunks; at 700 keys, 20 splits of 64 keys leave
    # splits 11-19 empty, so a chunk is part filled and one is all empty.
    assert dec.merge_block_s(16, 64) == 8
    kv_lens = [700, 300, 9]
    b = make_batch([1] * 3, kv_lens, 8, 2, 64, torch.float32)
    ref = decode_reference(b)
    for splits in ([9, 9, 9], [20, 20, 20], [17, 8, 1]):
        out = run_decode(b, 20, torch.tensor(splits, dtype=torch.int32))
        assert_close(out, ref, torch.float32)


def test_decode_merges_one_split_per_load_for_the_widest_head_tile():
    # 64 query heads on one kv head in bf16: a 64-row head tile of 128-wide
    # values fills the merge's chunk alone (merge_block_s 1: a wider chunk
    # spills registers on sm_90).
    assert dec.merge_block_s(64, 128) == 1
    b = make_batch([1, 1], [200, 70], 64, 1, 128, torch.bfloat16)
    out = run_decode(b, 4, torch.tensor([4, 3], dtype=torch.int32))
    assert_close(out, decode_reference(b), torch.bfloat16)


@pytest.mark.parametrize(
    "block_n,num_warps,num_stages,merge_splits", [(32, 4, 2, None), (64, 4, 3, 2), (128, 8, 2, 1), (64, 4, 3, 4)]
)
def test_decode_launch_settings_change_speed_not_answers(block_n, num_warps, num_stages, merge_splits):
    # Key tiles wider than some splits and than some requests' keys; merge
    # chunks narrower than the 3 splits (several chunks) and wider.
    b = make_batch([1] * 4, [1, 70, 129, 300], 8, 2, 64, torch.bfloat16)
    launch = DecodeLaunch(block_n, num_warps, num_stages, cap_splits=False, merge_splits=merge_splits)
    out = run_decode(b, 3, torch.tensor([1, 2, 3, 3], dtype=torch.int32), launch)
    assert_close(out, decode_reference(b), torch.bfloat16)


def test_grid_splits_are_the_most_within_the_programs_per_sm(monkeypatch):
    monkeypatch.setattr(dec, "_num_sms", lambda device: 132)
    dec.grid_kv_splits.cache_clear()
    try:
        cuda = torch.device("cuda")

        def grid(bs, max_splits=64, dtype=torch.bfloat16, hq=32, hkv=8, head_dim=128, launch=None):
            return grid_kv_splits(bs, hq, hkv, dtype, max_splits, cuda, launch, head_dim=head_dim)

        # head_dim 128: 2 programs an SM = 264: 8 programs per split at bs 1,
        # 256 at bs 32 (one split: a second would pass 264).
        assert dec.default_programs_per_sm(128, 128) == 2 and dec.default_programs_per_sm(64, 64) == 4
        assert dec.default_programs_per_sm(64, 128) == 2
        assert [grid(1), grid(32), grid(33), grid(128)] == [33, 1, 1, 1]
        assert grid(1, max_splits=16) == 16
        # head_dim 64: 4 programs an SM = 528; at 1 kv head and bs 33, 528 // 33 = 16.
        assert grid(32, head_dim=64) == 2 and grid(8, head_dim=64) == 8
        assert grid(33, hq=8, hkv=1, head_dim=64) == 16
        # An explicit count overrides the default; cap_splits=False: the maximum.
        assert grid(32, head_dim=64, launch=DecodeLaunch(programs_per_sm=1)) == 1
        assert grid(32, launch=DecodeLaunch(cap_splits=False)) == 64
        # Wide groups take several programs per kv head (up to 64 heads each).
        assert grid(1, max_splits=512, hq=64, hkv=1) == 264
        assert grid(1, max_splits=512, hq=128, hkv=1) == 132
        # No SM count off CUDA (the interpreter): the caller's maximum.
        assert grid_kv_splits(1, 32, 8, torch.bfloat16, 64, CPU, head_dim=64) == 64
    finally:
        dec.grid_kv_splits.cache_clear()


def test_bad_launch_settings_and_split_bounds_say_what_was_expected():
    for bad in (dict(block_n=48), dict(block_n=8), dict(num_warps=3), dict(num_stages=0),
                dict(programs_per_sm=0), dict(cap_splits=1), dict(merge_splits=3), dict(merge_splits=0)):  # fmt: skip
        with pytest.raises(InvalidInputError, match="expected"):
            DecodeLaunch(**bad)
    with pytest.raises(InvalidInputError, match="max_kv_splits: expected a positive int, got 0"):
        grid_kv_splits(1, 8, 2, torch.bfloat16, 0, CPU, head_dim=64)
    with pytest.raises(InvalidInputError, match="num_q_heads a multiple of num_kv_heads"):
        grid_kv_splits(1, 6, 4, torch.bfloat16, 8, CPU, head_dim=64)
    with pytest.raises(InvalidInputError, match="head_dim: expected a positive int, got 0"):
        grid_kv_splits(1, 8, 2, torch.bfloat16, 8, CPU, head_dim=0)
    b = make_batch([1, 1], [3, 4], 4, 2, 32, torch.float32)
    with pytest.raises(InvalidInputError, match="max_kv_splits: expected a positive int"):
        run_decode(b, 0, torch.ones(2, dtype=torch.int32))


def test_choose_num_kv_splits_scales_with_length_and_caps():
    kv_lens = torch.tensor([0, 1, 256, 257, 1000, 100000])
    out = torch.empty(6, dtype=torch.int32)
    # ceil(len / 256) clamped to [1, 8]
    assert choose_num_kv_splits(kv_lens, 8, out, tokens_per_split=256).tolist() == [1, 1, 1, 2, 4, 8]
    # The default: one split per 64 keys.
    assert choose_num_kv_splits(kv_lens, 8, out).tolist() == [1, 1, 4, 5, 8, 8]
    with pytest.raises(ValueError):
        choose_num_kv_splits(kv_lens, 0, out)


def _decode_scratch(rows: int, num_q_heads: int, dv: int, max_kv_splits: int, device=CPU):
    # Stale NaNs in the scratch: a split that is never written must never be read.
    logits = torch.full((rows, num_q_heads, max_kv_splits, dv), float("nan"), device=device)
    lse = torch.full((rows, num_q_heads, max_kv_splits), float("nan"), device=device)
    return logits, lse, torch.zeros(rows, num_q_heads, dtype=torch.int32, device=device)


def _check_decode_with_new_kv(dtype, kv_lens, device=CPU, hq=8, hkv=2, d=32, max_splits=8, launches=1):
    """Returns the split counts and the last launch's plan."""
    # Each request's last key is its new token, whose pool slot holds NaN
    # until the launch writes it; two padded rows follow the requests.
    bs = len(kv_lens)
    rows = bs + 2
    b = make_batch([1] * bs, kv_lens, hq, hkv, d, dtype, device=device)
    last = [int(b.kv_indptr[r + 1]) - 1 for r in range(bs)]
    # The slots at an 8-byte (not 16-byte) aligned address, as a slice of a batch's slots can be.
    loc = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), b.kv_indices[last].long()])[1:]
    new_k = torch.randn(rows, hkv, d, device=device).to(dtype)
    new_v = torch.randn(rows, hkv, d, device=device).to(dtype)
    expected_pool_k, expected_pool_v = b.k_cache.clone(), b.v_cache.clone()
    expected_pool_k[loc], expected_pool_v[loc] = new_k[:bs], new_v[:bs]
    q = torch.cat([b.q, torch.full((rows - bs, hq, d), float("nan"), device=device).to(dtype)])
    kv_lens_t = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    splits = choose_num_kv_splits(kv_lens_t, max_splits, torch.empty_like(kv_lens_t))
    logits, lse, counts = _decode_scratch(bs, hq, d, max_splits, device)
    outs = []
    for _ in range(launches):  # every launch must leave the arrival counts at zero for the next
        b.k_cache[loc], b.v_cache[loc] = float("nan"), float("nan")
        out = torch.full((rows, hq, d), float("nan"), device=device).to(dtype)
        plan = decode_attention(
            q, b.k_cache, b.v_cache, out, b.kv_indptr, b.kv_indices, logits, lse, counts, splits, max_splits,
            d**-0.5, new_k=new_k, new_v=new_v, out_cache_loc=loc, num_rows=bs,
        )  # fmt: skip
        outs.append(out)
    # Exactly the real requests' new rows were written, nothing else.
    assert torch.equal(b.k_cache, expected_pool_k) and torch.equal(b.v_cache, expected_pool_v)
    assert_close(outs[0][:bs], decode_reference(b), dtype)
    assert torch.equal(outs[0][bs:], torch.zeros_like(outs[0][bs:]))
    assert all(torch.equal(out, outs[0]) for out in outs)
    assert torch.equal(counts, torch.zeros_like(counts))
    return splits, plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_new_kv_writes_the_pool_and_attends_padded_rows_to_zero(dtype):
    splits, _ = _check_decode_with_new_kv(dtype, [1, 40, 300])
    assert splits.tolist() == [1, 1, 5]  # one request goes through the merge


def test_a_plan_refuses_next_step_slots_it_cannot_take_and_keeps_its_own():
    _, plan = _check_decode_with_new_kv(torch.float32, [1, 40, 300])
    slots = plan._slots
    bad = [
        (torch.zeros(3, dtype=torch.int32), r"expected out_cache_loc int64 \[>=3\], got torch.int32 \[3\]"),
        (torch.zeros(2, dtype=torch.int64), r"expected out_cache_loc int64 \[>=3\], got torch.int64 \[2\]"),
        (torch.zeros(3, 2, dtype=torch.int64)[:, 0], "expected out_cache_loc contiguous on cpu, got cpu with stride 2"),
    ]
    for loc, message in bad:
        with pytest.raises(InvalidInputError, match=message):
            plan.rebind_slots(loc)
        assert plan._slots is slots and plan._launch._args[dec._SLOTS_ARG] is slots
    assert not plan.rebind_slots(None)  # no slots: build a plan, which names what is missing


def test_decode_plan_launches_another_layer_like_a_fresh_call():
    kv_lens, hq, hkv, d = [5, 70, 129], 4, 2, 16
    layers = [make_batch([1] * 3, kv_lens, hq, hkv, d, torch.float32) for _ in range(2)]
    for b in layers[1:]:  # one request table, two layers' pools
        b.kv_indptr, b.kv_indices, b.q = layers[0].kv_indptr, layers[0].kv_indices, layers[0].q
    splits = torch.tensor([1, 2, 3], dtype=torch.int32)
    args = lambda b, out: (b.q, b.k_cache, b.v_cache, out, b.kv_indptr, b.kv_indices)  # noqa: E731
    outs = [torch.empty(3, hq, d) for _ in range(3)]
    plan = decode_attention(*args(layers[0], outs[0]), *_decode_scratch(3, hq, d, 4), splits, 4, 0.25)
    assert plan.launch(layers[1].q, layers[1].k_cache, layers[1].v_cache, outs[1])
    decode_attention(*args(layers[1], outs[2]), *_decode_scratch(3, hq, d, 4), splits, 4, 0.25)
    assert torch.equal(outs[1], outs[2])
    # A layer laid out unlike the plan's first is refused, not launched.
    strided_q = torch.randn(3, hq + 2, d)[:, :hq]
    assert not plan.launch(strided_q, layers[1].k_cache, layers[1].v_cache, outs[1])
    # So is one whose output has fewer rows (the kernel would write past it),
    # a value pool of another width, or another dtype.
    short_out = torch.full((2, hq, d), float("nan"))
    assert not plan.launch(layers[1].q, layers[1].k_cache, layers[1].v_cache, short_out)
    narrow_v = torch.randn(layers[1].v_cache.shape[0], hkv, d // 2)
    assert not plan.launch(layers[1].q, layers[1].k_cache, narrow_v, outs[1])
    half = [t.half() for t in (layers[1].q, layers[1].k_cache, layers[1].v_cache, outs[1])]
    assert not plan.launch(*half)
    assert torch.isnan(short_out).all() and torch.equal(outs[1], outs[2])  # nothing was written


def test_decode_rejects_bad_merge_counts_and_new_kv():
    b = make_batch([1, 1], [3, 4], 4, 2, 32, torch.float32)
    out, splits = torch.empty(2, 4, 32), torch.ones(2, dtype=torch.int32)
    logits, lse, counts = _decode_scratch(2, 4, 32, 2)
    common = (b.q, b.k_cache, b.v_cache, out, b.kv_indptr, b.kv_indices, logits, lse)
    with pytest.raises(InvalidInputError, match="merge_counts int32"):
        decode_attention(*common, counts.long(), splits, 2, 0.1)
    with pytest.raises(InvalidInputError, match="together"):
        decode_attention(*common, counts, splits, 2, 0.1, new_k=torch.empty(2, 2, 32))
    with pytest.raises(InvalidInputError, match="new_k"):
        decode_attention(
            *common, counts, splits, 2, 0.1,
            new_k=torch.empty(2, 2, 16), new_v=torch.empty(2, 2, 32), out_cache_loc=torch.zeros(2, dtype=torch.int64),
        )  # fmt: skip
    with pytest.raises(InvalidInputError, match="out_cache_loc int64"):
        decode_attention(
            *common, counts, splits, 2, 0.1,
            new_k=torch.empty(2, 2, 32), new_v=torch.empty(2, 2, 32), out_cache_loc=torch.zeros(2, dtype=torch.int32),
        )  # fmt: skip
    with pytest.raises(InvalidInputError, match="num_rows"):
        decode_attention(*common, counts, splits, 2, 0.1, num_rows=3)


def test_decode_rejects_mismatched_shapes():
    b = make_batch([1, 1], [3, 4], 4, 2, 32, torch.float32)
    bad_out = torch.empty(2, 4, 16)
    with pytest.raises(InvalidInputError, match="out"):
        decode_attention(
            b.q,
            b.k_cache,
            b.v_cache,
            bad_out,
            b.kv_indptr,
            b.kv_indices,
            torch.empty(2, 4, 2, 32),
            torch.empty(2, 4, 2),
            torch.zeros(2, 4, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32),
            2,
            0.1,
        )
    with pytest.raises(InvalidInputError, match="scratch"):
        decode_attention(
            b.q,
            b.k_cache,
            b.v_cache,
            torch.empty(2, 4, 32),
            b.kv_indptr,
            b.kv_indices,
            torch.empty(2, 4, 1, 32),
            torch.empty(2, 4, 1),
            torch.zeros(2, 4, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32),
            2,
            0.1,
        )


# ---------------------------------------------------------------- extend


def run_extend(b: PagedBatch, max_q_len: int, mask=None, mask_indptr=None) -> torch.Tensor:
    t, num_q_heads = b.q.shape[0], b.q.shape[1]
    out = torch.full((t, num_q_heads, b.v_cache.shape[2]), float("nan"), dtype=b.q.dtype, device=b.q.device)
    extend_attention(
        b.q,
        b.k_cache,
        b.v_cache,
        out,
        b.qo_indptr,
        b.kv_indptr,
        b.kv_indices,
        max_q_len,
        b.q.shape[2] ** -0.5,
        custom_mask=mask,
        mask_indptr=mask_indptr,
    )
    return out


def flat_mask(visible: List[torch.Tensor], dtype=torch.bool, indptr_dtype=torch.int32):
    mask = torch.cat([v.flatten() for v in visible]).to(dtype)
    indptr = _indptr([v.numel() for v in visible], CPU).to(indptr_dtype)
    return mask, indptr


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (8, 2), (7, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_causal_matches_reference(num_q_heads, num_kv_heads, dtype):
    # (q_len, prefix): a fresh prefill, a decode-like row, chunked prefills.
    shapes = [(37, 0), (1, 20), (9, 50), (70, 33)]
    q_lens = [q for q, _ in shapes]
    kv_lens = [q + p for q, p in shapes]
    b = make_batch(q_lens, kv_lens, num_q_heads, num_kv_heads, 64, dtype)
    ref = reference(b, 64**-0.5, [causal_visible(q, k) for q, k in zip(q_lens, kv_lens)])
    assert_close(run_extend(b, max(q_lens)), ref, dtype)


@pytest.mark.parametrize("head_dim,dv", [(80, 80), (128, 64), (256, 256)])
def test_extend_handles_head_dims(head_dim, dv):
    q_lens, kv_lens = [5, 20], [5, 44]
    b = make_batch(q_lens, kv_lens, 4, 2, head_dim, torch.float32, dv=dv)
    ref = reference(b, head_dim**-0.5, [causal_visible(q, k) for q, k in zip(q_lens, kv_lens)])
    assert_close(run_extend(b, max(q_lens)), ref, torch.float32)


def test_extend_static_grid_larger_than_batch_and_strided_q():
    # max_q_len is a static bound (a captured size): spare programs must exit.
    q_lens, kv_lens = [3, 1, 6], [3, 11, 30]
    b = make_batch(q_lens, kv_lens, 8, 4, 32, torch.float32, index_dtype=torch.int64, q_padded_heads=3)
    ref = reference(b, 32**-0.5, [causal_visible(q, k) for q, k in zip(q_lens, kv_lens)])
    assert_close(run_extend(b, 64), ref, torch.float32)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_tree_mask_matches_reference(num_q_heads, num_kv_heads, dtype):
    rng = random.Random(num_q_heads * 10 + num_kv_heads)
    q_lens = [4, 8, 1, 6]
    kv_lens = [q + p for q, p in zip(q_lens, [0, 45, 12, 70])]
    visible = [tree_visible(q, k, rng) for q, k in zip(q_lens, kv_lens)]
    b = make_batch(q_lens, kv_lens, num_q_heads, num_kv_heads, 64, dtype)
    mask, indptr = flat_mask(visible)
    assert_close(run_extend(b, 8, mask, indptr), reference(b, 64**-0.5, visible), dtype)


def test_extend_random_mask_uint8_int64_indptr_and_blind_rows():
    # Arbitrary masks, prefix columns included; a row that sees nothing is zeros.
    q_lens, kv_lens = [3, 17], [10, 80]
    visible = [torch.rand(q, k) < 0.3 for q, k in zip(q_lens, kv_lens)]
    visible[1][5] = False
    b = make_batch(q_lens, kv_lens, 6, 2, 32, torch.float32)
    mask, indptr = flat_mask(visible, torch.uint8, torch.int64)
    out = run_extend(b, 17, mask, indptr)
    assert_close(out, reference(b, 32**-0.5, visible), torch.float32)
    assert torch.equal(out[3 + 5], torch.zeros_like(out[3 + 5]))


def test_extend_rejects_mask_without_indptr():
    b = make_batch([2], [2], 2, 2, 16, torch.float32)
    with pytest.raises(InvalidInputError, match="mask_indptr"):
        extend_attention(
            b.q,
            b.k_cache,
            b.v_cache,
            torch.empty(2, 2, 16),
            b.qo_indptr,
            b.kv_indptr,
            b.kv_indices,
            2,
            0.25,
            custom_mask=torch.ones(4, dtype=torch.bool),
        )


def _extend_with_new_kv(b: PagedBatch, rows: int, device=CPU, mask=None, mask_indptr=None):
    """``b``'s new tokens' K/V as separate tensors, their slots, and the pool
    as the unfused path leaves it (the new rows written at those slots)."""
    hkv, d, dv = b.k_cache.shape[1], b.k_cache.shape[2], b.v_cache.shape[2]
    ends = [int(b.kv_indptr[r + 1]) for r in range(len(b.q_lens))]
    loc = torch.cat([b.kv_indices[end - q : end] for end, q in zip(ends, b.q_lens)]).long()
    t = loc.shape[0]
    new_k = torch.randn(rows, hkv, d, device=device).to(b.k_cache.dtype)
    new_v = torch.randn(rows, hkv, dv, device=device).to(b.v_cache.dtype)
    want_k, want_v = b.k_cache.clone(), b.v_cache.clone()
    want_k[loc], want_v[loc] = new_k[:t], new_v[:t]
    return loc, new_k, new_v, want_k, want_v


@pytest.mark.parametrize("masked", [False, True])
def test_extend_plan_writes_the_pool_attends_and_zeroes_padded_rows_like_the_unfused_path(masked):
    """The plan's K/V write + attention equals ``index_copy_`` + a fresh
    ``extend_attention`` bit for bit, on a second layer too; padded rows of
    ``q`` get zeros; a layer laid out unlike the first is refused."""
    rng = random.Random(7)
    q_lens, kv_lens, hq, hkv, d = [5, 1, 12], [5, 30, 40], 8, 2, 32
    t, rows = sum(q_lens), sum(q_lens) + 3
    layers = [make_batch(q_lens, kv_lens, hq, hkv, d, torch.float32) for _ in range(2)]
    layers[1].kv_indices, layers[1].q = layers[0].kv_indices, layers[0].q  # one request table
    mask, indptr = flat_mask([tree_visible(q, k, rng) for q, k in zip(q_lens, kv_lens)]) if masked else (None, None)
    q = torch.cat([layers[0].q, torch.full((rows - t, hq, d), float("nan"))])
    plan, outs = None, []
    for b in layers:
        loc, new_k, new_v, want_k, want_v = _extend_with_new_kv(b, rows)
        want = torch.full((t, hq, d), float("nan"))
        ref_k, ref_v = b.k_cache.clone(), b.v_cache.clone()
        ref_k[loc], ref_v[loc] = new_k[:t], new_v[:t]
        extend_attention(q[:t], ref_k, ref_v, want, b.qo_indptr, b.kv_indptr, b.kv_indices, 12, 0.2,
                         custom_mask=mask, mask_indptr=indptr)  # fmt: skip
        out = torch.full((rows, hq, d), float("nan"))
        if plan is None:
            plan = ExtendPlan(q, b.k_cache, b.v_cache, out, b.qo_indptr, b.kv_indptr, b.kv_indices, 12, 0.2,
                              mask, indptr, new_k=new_k, new_v=new_v, out_cache_loc=loc, num_rows=t)  # fmt: skip
        assert plan.launch(q, b.k_cache, b.v_cache, out, new_k, new_v)
        assert torch.equal(b.k_cache, want_k) and torch.equal(b.v_cache, want_v)
        assert torch.equal(out[:t], want) and torch.equal(out[t:], torch.zeros_like(out[t:]))
        outs.append(out)
    short_out = torch.full((rows - 1, hq, d), float("nan"))
    b = layers[1]
    assert not plan.launch(q, b.k_cache, b.v_cache, short_out, new_k, new_v)
    assert not plan.launch(q, b.k_cache, b.v_cache, outs[1], new_k[:, :, : d // 2], new_v)
    assert torch.isnan(short_out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_plan_with_the_kv_write_fused_equals_the_unfused_path(dtype):
    """``fuse_kv_write`` on an unpadded plain extend: one launch per layer,
    whose kernel writes the new K/V and reads the new keys from ``new_k`` /
    ``new_v``; bit for bit the store-then-attend path, pool included, on a
    second layer too. Padded rows or a tree mask keep the two launches."""
    q_lens, kv_lens, hq, hkv, d = [5, 1, 12], [5, 30, 40], 8, 2, 32
    t = sum(q_lens)
    layers = [make_batch(q_lens, kv_lens, hq, hkv, d, dtype) for _ in range(2)]
    layers[1].kv_indices, layers[1].q = layers[0].kv_indices, layers[0].q  # one request table
    q, plan = layers[0].q, None
    for b in layers:
        loc, new_k, new_v, want_k, want_v = _extend_with_new_kv(b, t)
        unfused_k, unfused_v = b.k_cache.clone(), b.v_cache.clone()
        want = torch.full((t, hq, d), float("nan"), dtype=dtype)
        store = ExtendPlan(q, unfused_k, unfused_v, want, b.qo_indptr, b.kv_indptr, b.kv_indices, 12, 0.2,
                           new_k=new_k, new_v=new_v, out_cache_loc=loc, num_rows=t)  # fmt: skip
        assert store._store is not None and store.launch(q, unfused_k, unfused_v, want, new_k, new_v)
        out = torch.full((t, hq, d), float("nan"), dtype=dtype)
        if plan is None:
            plan = ExtendPlan(q, b.k_cache, b.v_cache, out, b.qo_indptr, b.kv_indptr, b.kv_indices, 12, 0.2,
                              new_k=new_k, new_v=new_v, out_cache_loc=loc, num_rows=t, fuse_kv_write=True)  # fmt: skip
        assert plan._store is None and plan.launch(q, b.k_cache, b.v_cache, out, new_k, new_v)
        assert torch.equal(b.k_cache, want_k) and torch.equal(b.v_cache, want_v)
        assert torch.equal(out, want)
    b, two_more = layers[0], lambda x: torch.cat([x, x[:2]])  # two padded rows
    padded = ExtendPlan(two_more(q), b.k_cache, b.v_cache, two_more(out), b.qo_indptr, b.kv_indptr, b.kv_indices,
                        12, 0.2, new_k=two_more(new_k), new_v=two_more(new_v), out_cache_loc=loc, num_rows=t,
                        fuse_kv_write=True)  # fmt: skip
    assert padded._store is not None


def test_extend_plan_with_the_kv_write_fused_reads_no_new_key_from_the_pool():
    """The fused kernel takes every new key and value from ``new_k`` /
    ``new_v``, so no program reads a pool row another is writing: here the
    index entries of the new tokens name a NaN row, and nothing of it shows."""
    q_lens, kv_lens, hq, hkv, d = [3, 6], [7, 6], 4, 2, 16
    t = sum(q_lens)
    b = make_batch(q_lens, kv_lens, hq, hkv, d, torch.float32)
    loc, new_k, new_v, want_k, want_v = _extend_with_new_kv(b, t)
    want = torch.empty(t, hq, d)
    extend_attention(b.q, want_k.clone(), want_v.clone(), want, b.qo_indptr, b.kv_indptr, b.kv_indices, 6, 0.25)
    b.k_cache[0], b.v_cache[0] = float("nan"), float("nan")  # row 0: in no request's extent
    indices = b.kv_indices.clone()
    for end, q in zip(b.kv_indptr[1:].tolist(), q_lens):
        indices[end - q : end] = 0
    out = torch.full((t, hq, d), float("nan"))
    plan = ExtendPlan(b.q, b.k_cache, b.v_cache, out, b.qo_indptr, b.kv_indptr, indices, 6, 0.25,
                      new_k=new_k, new_v=new_v, out_cache_loc=loc, num_rows=t, fuse_kv_write=True)  # fmt: skip
    assert plan.launch(b.q, b.k_cache, b.v_cache, out, new_k, new_v)
    assert torch.equal(out, want)
    assert torch.equal(b.k_cache[1:], want_k[1:]) and torch.equal(b.v_cache[1:], want_v[1:])


def test_extend_plan_keeps_no_layer_tensor_alive():
    """A plan outlives its first layer; the layer's q, K/V and output must not
    (inside a graph pool, a tensor kept alive breaks the recording)."""
    b = make_batch([3, 2], [3, 9], 4, 2, 16, torch.float32)
    q, out = b.q.clone(), torch.empty(5, 4, 16)
    loc, new_k, new_v, _, _ = _extend_with_new_kv(b, 5)
    plan = ExtendPlan(q, b.k_cache, b.v_cache, out, b.qo_indptr, b.kv_indptr, b.kv_indices, 3, 0.25,
                      new_k=new_k, new_v=new_v, out_cache_loc=loc, num_rows=5)  # fmt: skip
    assert plan.launch(q, b.k_cache, b.v_cache, out, new_k, new_v)
    kept = [weakref.ref(t) for t in (q, out, new_k, new_v)]
    del q, out, new_k, new_v
    gc.collect()
    assert all(ref() is None for ref in kept)


def test_extend_plan_rejects_bad_new_kv_and_rows():
    b = make_batch([2, 3], [4, 3], 4, 2, 16, torch.float32)
    out, loc = torch.empty(5, 4, 16), torch.zeros(5, dtype=torch.int64)
    common = (b.q, b.k_cache, b.v_cache, out, b.qo_indptr, b.kv_indptr, b.kv_indices, 3, 0.25)
    good = torch.empty(5, 2, 16)
    with pytest.raises(InvalidInputError, match="new_k"):
        ExtendPlan(*common, new_k=torch.empty(5, 2, 8), new_v=good, out_cache_loc=loc, num_rows=5)
    with pytest.raises(InvalidInputError, match="out_cache_loc int64"):
        ExtendPlan(*common, new_k=good, new_v=good, out_cache_loc=loc.int(), num_rows=5)
    with pytest.raises(InvalidInputError, match="num_rows"):
        ExtendPlan(*common, new_k=good, new_v=good, out_cache_loc=loc, num_rows=6)
    # Slots the kernel would read with a stride of one: a strided view would write other slots.
    strided_loc = torch.zeros(10, dtype=torch.int64)[::2]
    with pytest.raises(InvalidInputError, match="out_cache_loc contiguous"):
        ExtendPlan(*common, new_k=good, new_v=good, out_cache_loc=strided_loc, num_rows=5)


# ---------------------------------------------------------------- GPU


def _random_lengths(rng: random.Random, n: int, lo: int, hi: int) -> List[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(32, 8, 128), (28, 4, 128), (16, 16, 64), (8, 1, 256)])
def test_gpu_decode_bf16_model_sizes(num_q_heads, num_kv_heads, head_dim):
    rng = random.Random(head_dim + num_q_heads)
    kv_lens = [0, 1] + _random_lengths(rng, 30, 2, 5000)
    cuda = torch.device("cuda")
    b = make_batch([1] * 32, kv_lens, num_q_heads, num_kv_heads, head_dim, torch.bfloat16, device=cuda)
    splits = torch.empty(32, dtype=torch.int32, device=cuda)
    choose_num_kv_splits(torch.tensor(kv_lens, device=cuda), 16, splits)
    assert_close(run_decode(b, 16, splits), decode_reference(b), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(32, 8, 128), (16, 16, 64), (8, 2, 256), (12, 2, 80)])
def test_gpu_extend_bf16_model_sizes(num_q_heads, num_kv_heads, head_dim):
    rng = random.Random(head_dim)
    q_lens = [1, 700] + _random_lengths(rng, 6, 2, 300)
    kv_lens = [q + p for q, p in zip(q_lens, [0, 0] + _random_lengths(rng, 6, 0, 2000))]
    cuda = torch.device("cuda")
    b = make_batch(q_lens, kv_lens, num_q_heads, num_kv_heads, head_dim, torch.bfloat16, device=cuda)
    ref = reference(b, head_dim**-0.5, [causal_visible(q, k) for q, k in zip(q_lens, kv_lens)])
    assert_close(run_extend(b, max(q_lens)), ref, torch.bfloat16)
    visible = [tree_visible(q, k, rng) for q, k in zip(q_lens, kv_lens)]
    mask, indptr = flat_mask(visible)
    out = run_extend(b, max(q_lens), mask.to(cuda), indptr.to(cuda))
    assert_close(out, reference(b, head_dim**-0.5, visible), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_decode_with_new_kv_merges_by_the_last_split_on_every_launch():
    # 64 requests of up to 8 splits on a real card: splits finish in any
    # order; 30 launches in a row with one set of arrival counts.
    rng = random.Random(5)
    kv_lens = [rng.randint(1, 1100) for _ in range(64)]
    cuda = torch.device("cuda")
    _, plan = _check_decode_with_new_kv(torch.bfloat16, kv_lens, cuda, hq=14, hkv=2, d=64, max_splits=8, launches=30)
    # Its next layer launches through the bound kernel: the step's slots need no 16-byte alignment.
    assert plan._launch._kernel is not None


@pytest.mark.gpu
def test_gpu_decode_plan_bound_launch_equals_a_fresh_call_bit_for_bit():
    cuda = torch.device("cuda")
    kv_lens, hq, hkv, d = [5, 700, 129, 1024], 14, 2, 64
    layers = [make_batch([1] * 4, kv_lens, hq, hkv, d, torch.bfloat16, device=cuda) for _ in range(2)]
    base = layers[0]
    splits = choose_num_kv_splits(torch.tensor(kv_lens, dtype=torch.int32, device=cuda), 16,
                                  torch.empty(4, dtype=torch.int32, device=cuda))  # fmt: skip
    scratch = _decode_scratch(4, hq, d, 16, cuda)
    outs = [torch.empty(4, hq, d, device=cuda, dtype=torch.bfloat16) for _ in range(3)]
    plan = decode_attention(base.q, base.k_cache, base.v_cache, outs[0], base.kv_indptr, base.kv_indices,
                            *scratch, splits, 16, 0.125)  # fmt: skip
    for _ in range(2):  # the second launch of a plan goes through its bound kernel
        assert plan.launch(base.q, layers[1].k_cache, layers[1].v_cache, outs[1])
    assert plan._launch._kernel is not None
    decode_attention(base.q, layers[1].k_cache, layers[1].v_cache, outs[2], base.kv_indptr, base.kv_indices,
                     *_decode_scratch(4, hq, d, 16, cuda), splits, 16, 0.125)  # fmt: skip
    assert torch.equal(outs[1], outs[2])


@pytest.mark.gpu
def test_gpu_a_layer_launched_again_takes_its_kept_arguments_and_new_slots_bit_for_bit():
    """A plan launched with a layer index keeps the layer's arguments: the
    same tensors launch again with nothing rebuilt, other tensors (or the
    same at a new address) take the checked path, and the next step's slots
    (``rebind_slots``) are written where they say, each launch equal to a
    fresh call."""
    cuda = torch.device("cuda")
    kv_lens, hq, hkv, d, bs = [5, 700, 129, 1024], 14, 2, 64, 4
    b = make_batch([1] * bs, kv_lens, hq, hkv, d, torch.bfloat16, device=cuda)
    last = torch.tensor([int(b.kv_indptr[r + 1]) - 1 for r in range(bs)], device=cuda)
    splits = choose_num_kv_splits(torch.tensor(kv_lens, dtype=torch.int32, device=cuda), 16,
                                  torch.empty(bs, dtype=torch.int32, device=cuda))  # fmt: skip
    new_k, new_v = (torch.randn(bs, hkv, d, device=cuda, dtype=torch.bfloat16) for _ in range(2))

    def fresh(q, slots):
        out, k_cache, v_cache = torch.empty_like(q), b.k_cache.clone(), b.v_cache.clone()
        scratch = _decode_scratch(bs, hq, d, 16, cuda)
        decode_attention(q, k_cache, v_cache, out, b.kv_indptr, kv_indices(slots), *scratch, splits, 16, 0.125,
                         new_k=new_k, new_v=new_v, out_cache_loc=slots)  # fmt: skip
        return out, k_cache, v_cache

    def kv_indices(slots):  # each request's last key is its new token, at its slot
        indices = b.kv_indices.clone()
        indices[last] = slots.to(indices.dtype)
        return indices

    # The requests' last slots, then the same slots handed round: each read by one request only.
    slots = [b.kv_indices[last].long(), b.kv_indices[last].long().roll(1)]
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    out = torch.empty_like(b.q)
    indices = kv_indices(slots[0])
    scratch = _decode_scratch(bs, hq, d, 16, cuda)
    plan = decode_attention(b.q, k_cache, v_cache, out, b.kv_indptr, indices, *scratch, splits, 16, 0.125,
                            new_k=new_k, new_v=new_v, out_cache_loc=slots[0])  # fmt: skip
    want = fresh(b.q, slots[0])
    for _ in range(3):  # the 2nd launch keeps the layer's arguments, the 3rd launches them again
        out.fill_(float("nan"))
        assert plan.launch(b.q, k_cache, v_cache, out, new_k, new_v, layer=0)
        assert all(torch.equal(x, y) for x, y in zip((out, k_cache, v_cache), want))
    assert set(plan._launch._layers) == {0}
    other_q = b.q.clone()  # same values, another tensor: the checked path, the same result
    assert plan.launch(other_q, k_cache, v_cache, out, new_k, new_v, layer=0)
    assert torch.equal(out, want[0])
    # The next step: its slots elsewhere, the page table rewritten in place.
    indices.copy_(kv_indices(slots[1]))
    assert plan.rebind_slots(slots[1]) and not plan._launch._layers
    want = fresh(b.q, slots[1])
    k_cache.copy_(b.k_cache), v_cache.copy_(b.v_cache)
    for _ in range(2):
        assert plan.launch(b.q, k_cache, v_cache, out, new_k, new_v, layer=0)
        assert all(torch.equal(x, y) for x, y in zip((out, k_cache, v_cache), want))


@pytest.mark.gpu
def test_gpu_extend_plan_bound_launches_equal_the_unfused_path_bit_for_bit():
    cuda = torch.device("cuda")
    q_lens, kv_lens, hq, hkv, d = [16, 3, 100], [16, 900, 400], 14, 2, 64
    t, rows = sum(q_lens), sum(q_lens) + 9
    b = make_batch(q_lens, kv_lens, hq, hkv, d, torch.bfloat16, device=cuda)
    q = torch.cat([b.q, torch.zeros(rows - t, hq, d, device=cuda, dtype=torch.bfloat16)])
    loc, new_k, new_v, want_k, want_v = _extend_with_new_kv(b, rows, cuda)
    want = torch.empty(t, hq, d, device=cuda, dtype=torch.bfloat16)
    extend_attention(b.q, want_k, want_v, want, b.qo_indptr, b.kv_indptr, b.kv_indices, 100, 0.125)
    out = torch.full((rows, hq, d), float("nan"), device=cuda, dtype=torch.bfloat16)
    plan = ExtendPlan(q, b.k_cache, b.v_cache, out, b.qo_indptr, b.kv_indptr, b.kv_indices, 100, 0.125,
                      new_k=new_k, new_v=new_v, out_cache_loc=loc, num_rows=t)  # fmt: skip
    for _ in range(3):  # later launches go through the bound kernels, pointers as integers
        out.fill_(float("nan"))
        assert plan.launch(q, b.k_cache, b.v_cache, out, new_k, new_v)
        assert torch.equal(b.k_cache, want_k) and torch.equal(b.v_cache, want_v)
        assert torch.equal(out[:t], want) and not out[t:].any()
    assert plan._attend._kernel is not None and plan._store._kernel is not None


@pytest.mark.gpu
def test_gpu_fp32_uses_accurate_dots():
    # fp32 runs 3xTF32 dots; plain TF32 would miss this tolerance.
    cuda = torch.device("cuda")
    q_lens, kv_lens = [1, 64, 200], [900, 64, 1200]
    b = make_batch(q_lens, kv_lens, 8, 2, 128, torch.float32, device=cuda)
    ref = reference(b, 128**-0.5, [causal_visible(q, k) for q, k in zip(q_lens, kv_lens)])
    assert_close(run_extend(b, 200), ref, torch.float32)
    d = make_batch([1] * 3, kv_lens, 8, 2, 128, torch.float32, device=cuda)
    assert_close(
        run_decode(d, 8, torch.full((3,), 8, dtype=torch.int32, device=cuda)), decode_reference(d), torch.float32
    )


@pytest.mark.gpu
def test_gpu_decode_and_extend_replay_in_a_cuda_graph_with_new_lengths():
    """Capture once on static buffers, refill them with another batch, replay."""
    cuda = torch.device("cuda")
    bs, hq, hkv, d, max_splits, cap = 8, 16, 4, 128, 8, 4096
    rng = random.Random(1)
    first = make_batch([2] * bs, _random_lengths(rng, bs, 2, 1500), hq, hkv, d, torch.bfloat16, device=cuda)
    # Static buffers sized for the largest batch; the graph sees only these.
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=cuda)
    kv_indices = torch.zeros(cap * bs, dtype=torch.int32, device=cuda)
    qo_indptr = torch.arange(0, 2 * bs + 1, 2, dtype=torch.int32, device=cuda)
    kv_lens_buf = torch.zeros(bs, dtype=torch.int32, device=cuda)
    splits = torch.zeros(bs, dtype=torch.int32, device=cuda)
    q_dec = torch.zeros(bs, hq, d, dtype=torch.bfloat16, device=cuda)
    q_ext = torch.zeros(2 * bs, hq, d, dtype=torch.bfloat16, device=cuda)
    out_dec = torch.zeros_like(q_dec)
    out_ext = torch.zeros_like(q_ext)
    logits = torch.empty(bs, hq, max_splits, d, device=cuda)
    lse = torch.empty(bs, hq, max_splits, device=cuda)
    counts = torch.zeros(bs, hq, dtype=torch.int32, device=cuda)
    k_cache, v_cache = first.k_cache, first.v_cache

    def step():
        choose_num_kv_splits(kv_lens_buf, max_splits, splits)
        decode_attention(
            q_dec, k_cache, v_cache, out_dec, kv_indptr, kv_indices, logits, lse, counts, splits, max_splits, d**-0.5
        )
        extend_attention(q_ext, k_cache, v_cache, out_ext, qo_indptr, kv_indptr, kv_indices, 2, d**-0.5)

    def load(b: PagedBatch):
        n = int(b.kv_indptr[-1])
        kv_indptr.copy_(b.kv_indptr)
        kv_indices[:n].copy_(b.kv_indices[:n])
        kv_lens_buf.copy_(b.kv_indptr[1:] - b.kv_indptr[:-1])
        q_ext.copy_(b.q)
        q_dec.copy_(b.q[1::2])

    load(first)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # A second batch over the same pool, with different lengths.
    # Fewer keys in all than the first batch, so the first batch's pool holds them.
    second_lens = [max(2, n - rng.randint(0, 300)) for n in reversed(first.kv_lens)]
    second = PagedBatch(
        q=torch.randn(2 * bs, hq, d, device=cuda).to(torch.bfloat16),
        k_cache=k_cache,
        v_cache=v_cache,
        qo_indptr=qo_indptr.clone(),
        kv_indptr=_indptr(second_lens, cuda),
        kv_indices=(torch.randperm(k_cache.shape[0] - 1, device=cuda)[: sum(second_lens)] + 1).to(torch.int32),
        q_lens=[2] * bs,
        kv_lens=second_lens,
    )
    load(second)
    graph.replay()
    torch.cuda.synchronize()
    ext_ref = reference(second, d**-0.5, [causal_visible(2, k) for k in second_lens])
    assert_close(out_ext, ext_ref, torch.bfloat16)
    # Decode row r is the second query token of request r: it sees every key.
    assert_close(out_dec, ext_ref[1::2], torch.bfloat16)


def test_slots_need_only_be_contiguous_as_read():
    from sgl_piecewise.backends.triton_kernels.tiles import check_slots

    column = torch.arange(8, dtype=torch.int64).view(2, 4)[:, 3]  # [2], stride 4
    check_slots("decode_attention", column[:1], 1, CPU)  # one slot: its stride is never used
    with pytest.raises(InvalidInputError, match="expected out_cache_loc contiguous on cpu, got cpu with stride 4"):
        check_slots("decode_attention", column, 2, CPU)
