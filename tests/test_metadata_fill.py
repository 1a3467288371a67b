"""The one-launch metadata fill (``fill_paged_metadata``) against the torch
helpers it replaces (``fill_lengths``, ``fill_kv_indices``,
``choose_num_kv_splits``): the same values, bit for bit, on fresh ragged
batches of every mode, including empty batches, zero-length requests, a page
table larger or smaller than the step's keys, and key extents past a row.
On a CPU the kernel runs under TRITON_INTERPRET=1 (set by conftest.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

from sgl_piecewise.backends.metadata import LengthMetadata, fill_kv_indices, fill_lengths  # noqa: E402
from sgl_piecewise.backends.triton_kernels import choose_num_kv_splits, fill_paged_metadata  # noqa: E402
from sgl_piecewise.errors import InvalidInputError  # noqa: E402
from sgl_piecewise.forward import ForwardMode  # noqa: E402

MODES = [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY,
         ForwardMode.DRAFT_EXTEND_V2, ForwardMode.IDLE]  # fmt: skip


def _poisoned_metadata(mode: ForwardMode, bs: int, width: int, device) -> LengthMetadata:
    """Metadata whose every entry holds a value no fill writes."""

    def poison(n: int) -> torch.Tensor:
        return torch.full((n,), -7, dtype=torch.int32, device=device)

    return LengthMetadata(mode, bs, width, bs * width, poison(bs), poison(bs), poison(bs + 1), poison(bs + 1), False)


def _both_fills(mode, rows, seq_lens, extend_lens, width, req_to_token, num_indices, max_splits, per_split):
    """(torch helpers' values, fused fill's values), each a dict of tensors."""
    bs, device = rows.shape[0], req_to_token.device
    results = []
    for fused in (False, True):
        meta = _poisoned_metadata(mode, bs, width, device)
        kv_indices = torch.full((num_indices,), -5, dtype=torch.int32, device=device)
        splits = torch.full((bs,), -3, dtype=torch.int32, device=device)
        if fused:
            fill_paged_metadata(
                meta, kv_indices, req_to_token, rows, seq_lens, extend_lens, splits, max_splits, per_split
            )
        else:
            fill_lengths(meta, seq_lens, extend_lens)
            fill_kv_indices(kv_indices, req_to_token, rows, meta.kv_indptr)
            choose_num_kv_splits(meta.kv_lens, max_splits, splits, per_split)
        results.append(dict(q_lens=meta.q_lens, kv_lens=meta.kv_lens, qo_indptr=meta.qo_indptr,
                            kv_indptr=meta.kv_indptr, kv_indices=kv_indices, num_kv_splits=splits))  # fmt: skip
    return results


def _assert_same(want: dict, got: dict, what: str) -> None:
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), f"{what}: {name}\n torch {tensor.tolist()}\n fused {got[name].tolist()}"


@settings(max_examples=40, deadline=None)
@given(
    mode=st.sampled_from(MODES),
    bs=st.integers(0, 9),
    uniform=st.booleans(),
    width=st.integers(1, 4),
    context=st.sampled_from([7, 40, 300]),
    slack=st.integers(-12, 1500),  # kv_indices entries beyond (or short of) the step's keys
    max_splits=st.integers(1, 9),
    per_split=st.sampled_from([1, 5, 128]),
    empty_every=st.integers(0, 3),  # every k-th request has no cached keys (0: none)
    seed=st.integers(0, 2**16),
)
def test_fused_fill_writes_what_the_torch_helpers_write(mode, bs, uniform, width, context, slack, max_splits,
                                                        per_split, empty_every, seed):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    max_reqs = bs + 3
    req_to_token = torch.randint(1, 10_000, (max_reqs, context), generator=gen, dtype=torch.int32)
    rows = torch.randperm(max_reqs, generator=gen)[:bs]
    # Up to one key past the row: the torch fill reads the row's last entry there, and so must the kernel.
    seq_lens = torch.randint(0, context + 2, (bs,), generator=gen)
    if empty_every:
        seq_lens[::empty_every] = 0
    extend_lens = None if uniform else torch.randint(0, 5, (bs,), generator=gen, dtype=torch.int32)
    new = width * bs if uniform else int(extend_lens.sum())
    add_new = new if mode.seq_lens_exclude_new_tokens() else 0
    num_indices = max(0, int(seq_lens.sum()) + add_new + slack)
    want, got = _both_fills(mode, rows, seq_lens, extend_lens, width, req_to_token, num_indices, max_splits, per_split)
    _assert_same(want, got, f"{mode.name} bs {bs}")


def test_fused_fill_rejects_other_dtypes_and_mismatched_batches():
    meta = _poisoned_metadata(ForwardMode.DECODE, 2, 1, "cpu")
    table = torch.zeros(4, 8, dtype=torch.int32)
    rows, lens = torch.tensor([0, 1]), torch.tensor([3, 4])
    with pytest.raises(InvalidInputError, match="expected int32"):
        fill_paged_metadata(meta, torch.zeros(16, dtype=torch.int64), table, rows, lens, None)
    with pytest.raises(InvalidInputError, match="expected int32"):
        fill_paged_metadata(meta, torch.zeros(16, dtype=torch.int32), table.t(), rows, lens, None)
    with pytest.raises(InvalidInputError, match="of 2 requests, got 3 and 2"):
        fill_paged_metadata(meta, torch.zeros(16, dtype=torch.int32), table, torch.tensor([0, 1, 2]), lens, None)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY])
@pytest.mark.parametrize("bs", [1, 33, 160])
def test_gpu_fused_fill_matches_the_torch_helpers_at_serving_sizes(mode, bs):
    gen = torch.Generator().manual_seed(bs)
    context, max_reqs = 4096, 200
    req_to_token = torch.randint(1, 1 << 20, (max_reqs, context), generator=gen, dtype=torch.int32).cuda()
    rows = torch.randperm(max_reqs, generator=gen)[:bs].cuda()
    seq_lens = torch.randint(0, context - 8, (bs,), generator=gen).cuda()
    extend_lens = None if mode != ForwardMode.EXTEND else torch.randint(1, 9, (bs,), generator=gen).cuda()
    want, got = _both_fills(mode, rows, seq_lens, extend_lens, 4, req_to_token, bs * context, 64, 128)
    _assert_same(want, got, f"{mode.name} bs {bs}")
