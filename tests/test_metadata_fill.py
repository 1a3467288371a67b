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


def test_fused_fill_rejects_bad_arguments_naming_them_and_writes_nothing():
    """Each argument the kernel would read or write out of bounds, as another
    dtype, or on another device: refused before the launch, by name."""
    table = torch.zeros(4, 8, dtype=torch.int32)
    rows, lens = torch.tensor([0, 1]), torch.tensor([3, 4])

    def call(meta=None, kv_indices=None, **changed):
        meta = meta if meta is not None else _poisoned_metadata(ForwardMode.DECODE, 2, 1, "cpu")
        kv_indices = kv_indices if kv_indices is not None else torch.full((16,), -5, dtype=torch.int32)
        args = dict(req_to_token=table, req_pool_indices=rows, seq_lens=lens, extend_lens=None) | changed
        fill_paged_metadata(meta, kv_indices, **args)
        return meta, kv_indices

    short_indptr = _poisoned_metadata(ForwardMode.DECODE, 2, 1, "cpu")
    short_indptr.kv_indptr = short_indptr.kv_indptr[:2]
    cases = [
        (
            dict(kv_indices=torch.zeros(16, dtype=torch.int64)),
            "kv_indices: expected dtype torch.int32, got torch.int64",
        ),
        (dict(req_to_token=table.t()), "expected req_to_token contiguous in its last dim"),
        (dict(req_to_token=table[0]), r"req_to_token: expected shape \[\*, \*\], got \[8\]"),
        (dict(req_pool_indices=torch.tensor([0, 1, 2])), r"req_pool_indices: expected shape \[2\], got \[3\]"),
        (dict(seq_lens=torch.tensor([3.0, 4.0])), "seq_lens: expected dtype torch.int32 or torch.int64"),
        (dict(extend_lens=torch.tensor([1])), r"extend_lens: expected shape \[2\], got \[1\]"),
        (dict(seq_lens=torch.tensor([3, 4, 5, 6])[::2]), "expected seq_lens contiguous in its last dim"),
        (dict(meta=short_indptr), r"meta.kv_indptr: expected shape \[3\], got \[2\]"),
        (dict(num_kv_splits=torch.zeros(3, dtype=torch.int32)), r"num_kv_splits: expected shape \[2\]"),
        (dict(kv_indices=torch.zeros(16, dtype=torch.int32, device="meta")), "kv_indices: expected device cpu"),
        (dict(num_kv_splits=torch.zeros(2, dtype=torch.int32), max_kv_splits=0), "max_kv_splits: expected a positive"),
        (dict(tokens_per_split=0), "tokens_per_split: expected a positive int"),
    ]
    for changed, message in cases:
        meta = changed.pop("meta", None)
        kv_indices = changed.pop("kv_indices", None)
        with pytest.raises(InvalidInputError, match=message):
            call(meta, kv_indices, **changed)
    # Refused before the launch: nothing written.
    meta, kv_indices = _poisoned_metadata(ForwardMode.DECODE, 2, 1, "cpu"), torch.full((16,), -5, dtype=torch.int32)
    with pytest.raises(InvalidInputError):
        call(meta, kv_indices, extend_lens=torch.tensor([1]))
    assert (meta.kv_indptr == -7).all() and (kv_indices == -5).all()
    meta, kv_indices = call()  # and the same call with good arguments fills
    assert meta.kv_indptr.tolist() == [0, 3, 7] and kv_indices[7:].eq(0).all()


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
