"""The buffer registry (upstream SGLang PR 26742): slots, padding policies, fills, hooks
and grouped copies. The shared pool, num_token_non_padded and the runners'
two registries are in ``test_input_registries.py``.

Every fill draws fresh random data; "tail" is rows ``[raw, padded)``.
"""

import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from sgl_piecewise.errors import InvalidInputError, InvalidTypeError
from sgl_piecewise.graphs import buffer_registry
from sgl_piecewise.graphs.buffer_registry import (
    CudaGraphBufferRegistry,
    FillContext,
    MissingSource,
    PaddingPolicy,
)
from sgl_piecewise.graphs.input_registries import build_decode_registry
from sgl_piecewise.internals import foreach_copy
from sgl_piecewise.memory import DUMMY_SLOT

P = PaddingPolicy
COPYING = [P.KEEP_PAD, P.FILL_SENTINEL, P.ZERO, P.FOREACH_COPY]
MAX_BS, MAX_TOKENS = 8, 16
I32, I64 = torch.int32, torch.int64


def rows(bs, nt):
    return (bs,)


def bad(match, err=InvalidInputError):
    return pytest.raises(err, match=match)


def decode_(max_bs=MAX_BS, **kw):
    return build_decode_registry(max_bs, "cpu", seq_len_fill_value=kw.pop("fill", 1), **kw)


def reg_(**kw):
    return CudaGraphBufferRegistry(MAX_BS, MAX_TOKENS, "cpu", **kw)


def slot_(reg, name="x", policy=P.KEEP_PAD, pad_value=-7, dtype=I64, **kw):
    kw.update(padding_policy=policy, pad_value=pad_value)
    return reg.register_slot(name, rows, dtype, "bs", **kw)


def ctx_(raw, padded):
    return FillContext(raw, padded, raw, padded)


def rand(n, dtype=I64):
    return torch.randint(1, 1000, (n,), dtype=dtype)


def _decode_sources(raw, width=1):
    n = raw * width
    return {
        "input_ids": rand(n), "positions": rand(n), "out_cache_loc": rand(n),
        "seq_lens": rand(raw, I32), "seq_lens_cpu": rand(raw, I32), "req_pool_indices": rand(raw),
        "extend_seq_lens": torch.full((raw,), width, dtype=I32),
    }  # fmt: skip


def scramble(slot):
    """Fresh random contents, so 'left as is' cannot pass by accident."""
    slot.buffer.copy_(rand(slot.buffer.shape[0], slot.buffer.dtype))
    return slot.buffer.clone()


# ---- declaration -------------------------------------------------------------
def test_register_allocates_the_registry_maximum_along_each_axis():
    reg = reg_()
    a = reg.register_slot("a", rows, I32, "bs")
    b = reg.register_slot("b", lambda bs, nt: (nt, 3), torch.float16, "tokens")
    c = reg.register_slot("c", lambda bs, nt: (), I32, "none")
    assert (a.buffer.shape, b.buffer.shape, c.buffer.shape) == ((8,), (16, 3), ())
    assert (a.buffer.dtype, b.buffer.dtype) == (I32, torch.float16)
    assert a.device == torch.device("cpu")
    assert reg.names == ("a", "b", "c") and reg.get_slot("b") is b


@pytest.mark.parametrize("policy", list(P))
def test_allocated_buffer_starts_at_its_policy_value(policy):
    kw = {"copy_from_fb": False} if policy is P.FILL_ONCE else {}
    slot = slot_(reg_(), policy=policy, pad_value=5, **kw)
    # Graphs captured before the first fill read defined values, never garbage.
    want = 5 if policy in (P.FILL_SENTINEL, P.FILL_ONCE) else 0
    assert torch.equal(slot.buffer, torch.full((MAX_BS,), want))


def test_duplicate_slot_name_is_rejected():
    reg = reg_()
    slot_(reg, "seq_lens")
    with bad("'seq_lens': expected a new name, got a duplicate"):
        slot_(reg, "seq_lens")


NONE_AXIS = {"axis": "none", "shape_fn": lambda bs, nt: (), "copy_from_fb": False}


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"axis": "batch"}, r"axis: expected one of \('bs', 'tokens', 'none'\), got 'batch'"),
        *[
            ({**NONE_AXIS, "padding_policy": p}, f"expected padding_policy KEEP_PAD, got {p.name}")
            for p in (P.FILL_SENTINEL, P.ZERO, P.FOREACH_COPY, P.FILL_ONCE)
        ],
        ({"padding_policy": P.FILL_ONCE}, "FILL_ONCE slot is a constant: expected copy_from_fb="),
        ({"shape_fn": lambda bs, nt: (4,)}, r"at least 8 rows along bs .*got shape \[4\]"),
        ({"bind": torch.zeros(8, dtype=I32)}, "expected dtype torch.int64, got torch.int32"),
        ({"bind": torch.zeros(5, dtype=I64)}, r"at least 8 rows along bs\), got \[5\]"),
    ],
)
def test_bad_declaration_says_what_was_expected(kw, match):
    with bad(match):
        reg_().register_slot(**{"name": "x", "shape_fn": rows, "dtype": I64, "axis": "bs", **kw})


def test_bind_adopts_the_same_storage_without_writing_it():
    mine = rand(10)  # more rows than the maximum is fine
    before = mine.clone()
    reg = reg_()
    slot = slot_(reg, policy=P.FILL_SENTINEL, bind=mine)
    assert slot.buffer.data_ptr() == mine.data_ptr() and torch.equal(mine, before)
    src = rand(3)
    reg.fill_from({"x": src}, ctx_(3, 5))  # fills land in the caller's tensor
    assert torch.equal(mine[:5], torch.cat([src, torch.full((2,), -7)]))


# ---- views -------------------------------------------------------------------
def test_slice_for_cuts_the_padded_axis_and_slice_fn_overrides_it():
    reg = reg_()
    a = slot_(reg, "a")
    t = reg.register_slot("t", lambda bs, nt: (nt,), I64, "tokens")
    n = reg.register_slot("n", lambda bs, nt: (), I32, "none")
    cu_shape, cu_slice = (lambda bs, nt: (bs + 1,)), (lambda buf, bs, nt: buf[: bs + 1])
    cu = reg.register_slot("cu", cu_shape, I32, "bs", copy_from_fb=False, slice_fn=cu_slice)
    assert [len(s.slice_for(3, 5)) for s in (a, t, cu)] == [3, 5, 4]
    assert n.slice_for(3, 5) is n.buffer
    with bad("expected at most 8 rows along bs, got 9"):
        a.slice_for(9, 5)


def test_views_share_storage_so_a_captured_graph_sees_later_fills():
    reg = reg_()
    slot = slot_(reg, policy=P.FILL_SENTINEL)
    captured = reg.extract(ctx_(4, 6))["x"]  # what a graph of 6 rows was captured on
    assert captured.data_ptr() == slot.buffer.data_ptr()
    src = rand(4)
    reg.fill_from({"x": src}, ctx_(4, 6))
    assert torch.equal(captured, torch.cat([src, torch.full((2,), -7)]))


def test_addresses_never_change_across_fills():
    reg = decode_()
    ptrs = {s.name: s.buffer.data_ptr() for s in reg}
    for raw, padded in [(3, 4), (8, 8), (1, 8), (0, 2)]:
        ctx = FillContext.uniform(raw, padded)
        reg.fill_from(_decode_sources(raw), ctx)
        assert {s.name: s.buffer.data_ptr() for s in reg} == ptrs
        assert {n: v.data_ptr() for n, v in reg.extract(ctx).items()} == ptrs


# ---- FillContext -------------------------------------------------------------
@pytest.mark.parametrize(
    "args, match",
    [((3, 2, 1, 1), "raw_bs <= padded_bs, got 3"), ((1, 1, 5, 4), "5 > 4"), ((-1, 0, 0, 0), "-1")],
)
def test_fill_context_is_validated(args, match):
    with bad(match):
        FillContext(*args)


def test_fill_context_uniform_gives_every_request_the_same_width():
    assert FillContext.uniform(3, 4, tokens_per_req=2) == FillContext(3, 4, 6, 8)


# ---- padding policies --------------------------------------------------------
@pytest.mark.parametrize("raw, padded", [(3, 6), (5, 5)])
@pytest.mark.parametrize(
    "policy, tail",
    [(P.KEEP_PAD, "as is"), (P.FOREACH_COPY, "as is"), (P.FILL_SENTINEL, -7), (P.ZERO, 0)],
)
def test_policy_copies_the_head_and_sets_the_tail(policy, tail, raw, padded):
    reg = reg_()
    slot = slot_(reg, policy=policy)
    before = scramble(slot)
    src = rand(raw)
    reg.fill_from({"x": src}, ctx_(raw, padded))
    buf = slot.buffer
    want_tail = before[raw:padded] if tail == "as is" else torch.full((padded - raw,), tail)
    assert torch.equal(buf[:raw], src) and torch.equal(buf[raw:padded], want_tail)
    assert torch.equal(buf[padded:], before[padded:])  # beyond the padded size: never touched


def test_fill_once_is_never_written_by_fill_from():
    reg = reg_()
    const = slot_(reg, policy=P.FILL_ONCE, pad_value=3, copy_from_fb=False)
    for raw, padded in [(2, 8), (8, 8)]:
        reg.fill_from({"x": rand(raw)}, ctx_(raw, padded))
        assert torch.equal(const.buffer, torch.full((8,), 3))


def test_poison_tails_marks_keep_pad_tails_and_nothing_else():
    reg = reg_(poison_tails=True)
    keep = slot_(reg, "keep")
    ids = slot_(reg, "ids", policy=P.FOREACH_COPY)
    f = reg.register_slot("f", rows, torch.float32, "bs")
    ids_before = scramble(ids)
    reg.fill_from({"keep": rand(2), "ids": rand(2), "f": torch.rand(2)}, ctx_(2, 4))
    assert torch.equal(keep.buffer[2:4], torch.full((2,), torch.iinfo(I64).min))
    assert f.buffer[2:4].isnan().all()
    # FOREACH_COPY tails are read by the graph, so they are never poisoned.
    assert torch.equal(ids.buffer[2:], ids_before[2:])


# ---- sources -----------------------------------------------------------------
def test_source_fn_replaces_the_attribute():
    reg = reg_()
    slot = slot_(reg, source_fn=lambda b: b.other)
    src = rand(3)
    reg.fill_from(SimpleNamespace(other=src), ctx_(3, 3))
    assert torch.equal(slot.buffer[:3], src)


def test_slot_without_copy_from_fb_is_untouched_and_its_source_never_read():
    reg = reg_()
    calls = []
    slot = slot_(reg, policy=P.ZERO, copy_from_fb=False, source_fn=calls.append)
    before = scramble(slot)
    reg.fill_from(SimpleNamespace(), ctx_(2, 6))  # no attribute "x" at all
    assert torch.equal(slot.buffer, before) and calls == []


def test_missing_required_source_is_an_error():
    reg = reg_()
    slot_(reg)
    with bad("'x': expected a source tensor, got None.*when_missing"):
        reg.fill_from(SimpleNamespace(x=None), ctx_(2, 2))


def test_missing_optional_source_is_skipped_or_padded_as_declared():
    reg = reg_()
    skip = slot_(reg, "skip", policy=P.ZERO, when_missing=MissingSource.SKIP)
    pad = slot_(reg, "pad", policy=P.FILL_SENTINEL, when_missing=MissingSource.PAD)
    skip_before, pad_before = scramble(skip), scramble(pad)
    reg.fill_from({}, ctx_(2, 5))
    assert torch.equal(skip.buffer, skip_before)
    assert torch.equal(pad.buffer[:5], torch.full((5,), -7))  # every row is padding
    assert torch.equal(pad.buffer[5:], pad_before[5:])


def test_source_dtype_is_cast_when_safe_and_rejected_otherwise():
    reg = reg_()
    slot = slot_(reg, dtype=I64)
    src = rand(3, I32)
    reg.fill_from({"x": src}, ctx_(3, 3))  # widening: every value survives
    assert torch.equal(slot.buffer[:3], src.to(I64))
    with bad("casts safely to torch.int64.*got torch.float32"):
        reg.fill_from({"x": torch.rand(3)}, ctx_(3, 3))


def test_one_size_filled_from_sources_of_changing_kinds_writes_each_as_given():
    # A plan is kept per set of sizes and source kinds: an exact source, a
    # cast one and a missing one alternate at one size, each written as given.
    reg = reg_()
    slot = slot_(reg, policy=P.FILL_SENTINEL, dtype=I64, when_missing=MissingSource.PAD)
    for src in (rand(3), rand(3, I32), None, rand(3), None, rand(3, I32)):
        scramble(slot)
        reg.fill_from({"x": src}, ctx_(3, 5))
        want = [-7] * 5 if src is None else src.tolist() + [-7, -7]
        assert slot.buffer[:5].tolist() == want
    with bad("casts safely to torch.int64.*got torch.float32"):
        reg.fill_from({"x": torch.rand(3)}, ctx_(3, 5))


def test_int64_source_is_refused_by_an_int32_slot_rather_than_wrapped():
    reg = reg_()
    slot = slot_(reg, dtype=I32)
    before = slot.buffer.clone()
    # 2**31 would wrap to -2**31 in an int32 slot.
    with bad("casts safely to torch.int32.*got torch.int64"):
        reg.fill_from({"x": torch.tensor([1, 2**31, 3])}, ctx_(3, 3))
    assert torch.equal(slot.buffer, before)


# ---- hooks -------------------------------------------------------------------
def test_post_fill_hooks_run_after_all_copies_in_registration_order():
    reg = reg_()
    seen = []

    def hook(slot, batch, ctx):
        # Every copy is done before any hook: both heads already hold the batch.
        heads = [reg.get_slot(n).buffer[:2].tolist() for n in ("a", "c")]
        seen.append((slot.name, batch, ctx, *heads))

    slot_(reg, "b", post_fill=hook, copy_from_fb=False)
    slot_(reg, "a", post_fill=hook)
    slot_(reg, "c")
    batch, ctx = {"a": rand(2), "c": rand(2)}, ctx_(2, 3)
    reg.fill_from(batch, ctx)
    heads = (batch["a"].tolist(), batch["c"].tolist())
    assert seen == [("b", batch, ctx, *heads), ("a", batch, ctx, *heads)]


# ---- bad input ---------------------------------------------------------------
@pytest.mark.parametrize(
    "src, ctx, err, match",
    [
        (torch.zeros(4, dtype=I64), (3, 4), InvalidInputError, r"shape \[3\] \(raw bs count 3\)"),
        (torch.zeros(3, 2, dtype=I64), (3, 4), InvalidInputError, r"shape \[3\].*got \[3, 2\]"),
        (torch.zeros(3, dtype=I64, device="meta"), (3, 4), InvalidInputError, "cpu, got meta"),
        ([1, 2, 3], (3, 4), InvalidTypeError, "expected a torch.Tensor, got list"),
        # A batch larger than every buffer: rejected before any source is read.
        (torch.zeros(10, dtype=I64), (10, 10), InvalidInputError, "padded_bs: expected at most 8"),
    ],
)
def test_bad_input_is_rejected_with_what_was_expected(src, ctx, err, match):
    reg = reg_()
    slot_(reg)
    with bad(match, err):
        reg.fill_from({"x": src}, ctx_(*ctx))


def test_rejected_fill_leaves_every_buffer_unchanged():
    reg = reg_()
    good = slot_(reg, "good", policy=P.ZERO)
    slot_(reg, "bad")
    before = scramble(good)
    with pytest.raises(InvalidInputError):
        reg.fill_from({"good": rand(2), "bad": rand(5)}, ctx_(2, 6))
    assert torch.equal(good.buffer, before) and reg.stats.fills == 0


def test_rejected_fill_of_planned_sizes_leaves_every_buffer_unchanged():
    reg = decode_()
    reg.fill_from(_decode_sources(3), FillContext.uniform(3, 4))  # plans the fill of these sizes
    before = {slot.name: scramble(slot) for slot in reg if slot.buffer.dim()}
    sources = _decode_sources(3)
    sources["seq_lens"] = rand(4, I32)  # one source of the wrong length, after good ones
    with bad(r"slot 'seq_lens': source: expected shape \[3\]"):
        reg.fill_from(sources, FillContext.uniform(3, 4))
    assert all(torch.equal(reg.get_slot(name).buffer, b) for name, b in before.items())
    assert reg.stats.fills == 1


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, MAX_BS), st.integers(0, MAX_BS)), min_size=1, max_size=6),
    poison=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_a_fill_with_a_cast_source_writes_what_an_exact_fill_writes(sizes, poison, seed):
    # The same values reach two registries: as they are, and with input_ids
    # as int32, which a plan of its own casts. Sizes repeat and change, so
    # both registries reuse plans.
    torch.manual_seed(seed)
    exact, cast = decode_(poison_tails=poison), decode_(poison_tails=poison)
    for a, b in zip(exact, cast):
        a.buffer.copy_(torch.randint(1, 1000, a.buffer.shape, dtype=a.buffer.dtype))
        b.buffer.copy_(a.buffer)
    for x, y in sizes:
        raw, padded = min(x, y), max(x, y)
        sources = _decode_sources(raw)
        exact.fill_from(sources, FillContext.uniform(raw, padded))
        cast.fill_from({**sources, "input_ids": sources["input_ids"].to(I32)}, FillContext.uniform(raw, padded))
        for a, b in zip(exact, cast):
            assert torch.equal(a.buffer, b.buffer), (a.name, raw, padded)


# ---- grouped copy ------------------------------------------------------------
class _Ops(TorchDispatchMode):
    """Records every aten op run inside, with its tensors' dtypes and numbers."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("raw, padded", [(3, 4), (4, 4), (0, 8)])
def test_a_planned_fill_is_one_foreach_copy_per_dtype_and_nothing_else(raw, padded):
    # Tails and num_token_non_padded are copied from the registry's constants
    # in the heads' grouped copies: no fill_ per tail, no launch per hook.
    reg = decode_()
    sources = _decode_sources(raw)
    reg.fill_from(sources, FillContext.uniform(raw, padded))  # plans these sizes
    with _Ops() as seen:
        reg.fill_from(sources, FillContext.uniform(raw, padded))
    assert [func for func, _ in seen.ops] == [torch.ops.aten._foreach_copy_.default] * 2
    copies = {dsts[0].dtype: len(dsts) for _, (dsts, _srcs) in seen.ops}
    # Heads with rows: input_ids, positions, out_cache_loc, req_pool_indices
    # (int64); seq_lens, seq_lens_cpu, extend_seq_lens (int32). Tails: all but
    # input_ids's. Then num_token_non_padded (int32).
    heads64, heads32 = (4, 3) if raw else (0, 0)
    tails64, tails32 = (3, 3) if raw < padded else (0, 0)
    assert copies == {I64: heads64 + tails64, I32: heads32 + tails32 + 1}
    assert (reg.stats.foreach_copies, reg.stats.per_tensor_fallbacks) == (4, 0)
    assert int(reg.get_slot("num_token_non_padded").buffer) == raw
    assert reg.get_slot("out_cache_loc").buffer[raw:padded].eq(DUMMY_SLOT).all()


def test_a_tail_too_large_for_a_constant_is_filled_in_place(monkeypatch):
    monkeypatch.setattr(buffer_registry, "_MAX_CONSTANT_NUMEL", 2)
    reg = reg_()
    zero, sentinel = slot_(reg, "zero", P.ZERO), slot_(reg, "sentinel", P.FILL_SENTINEL)
    for raw in (6, 5):  # tails of 2 rows (copied from constants), then of 3 (filled in place)
        scramble(zero), scramble(sentinel)
        src = {"zero": rand(raw), "sentinel": rand(raw)}
        reg.fill_from(src, ctx_(raw, MAX_BS))
        tail = MAX_BS - raw
        assert zero.buffer.tolist() == src["zero"].tolist() + [0] * tail
        assert sentinel.buffer.tolist() == src["sentinel"].tolist() + [-7] * tail


def test_a_bound_buffer_that_is_not_contiguous_gets_its_tail_in_place():
    reg = reg_()
    strided = torch.zeros(2 * MAX_BS, dtype=I64)[::2]
    slot = slot_(reg, policy=P.FILL_SENTINEL, bind=strided)
    src = rand(3)
    reg.fill_from({"x": src}, ctx_(3, 6))
    assert strided[:3].tolist() == src.tolist() and strided[3:6].tolist() == [-7] * 3
    assert slot.buffer.data_ptr() == strided.data_ptr()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(axis="bs"), "expected axis='none'"),
        (dict(copy_from_fb=True), "copy_from_fb=False"),
        (dict(post_fill=lambda *a: None), "no post_fill"),
    ],
)
def test_value_from_sizes_is_for_a_whole_slot_written_by_nothing_else(kw, match):
    args = dict(axis="none", copy_from_fb=False, value_from_sizes=lambda ctx: ctx.raw_bs)
    args.update(kw)
    axis = args.pop("axis")
    shape = rows if axis == "bs" else (lambda bs, nt: ())
    with bad(match):
        reg_().register_slot("v", shape, I32, axis, **args)
    with bad("value_from_sizes: expected a callable, got 3", InvalidTypeError):
        reg_().register_slot("v", lambda bs, nt: (), I32, "none", copy_from_fb=False, value_from_sizes=3)


def test_value_from_sizes_that_is_not_a_number_is_refused_before_anything_is_written():
    reg = reg_()
    reg.register_slot("v", lambda bs, nt: (), I32, "none", copy_from_fb=False,
                      value_from_sizes=lambda ctx: torch.tensor(ctx.raw_bs))  # fmt: skip
    x = slot_(reg, "x", dtype=I32)
    before = scramble(x)
    for src in (rand(3, I32), rand(3, torch.int16)):  # a source as it is, and one to cast
        with bad("slot 'v': value_from_sizes: expected a number, got tensor", InvalidTypeError):
            reg.fill_from({"x": src}, ctx_(3, 5))
        assert torch.equal(x.buffer, before)


def test_value_from_sizes_is_written_by_the_planned_and_the_checked_fill():
    reg = reg_()
    value = reg.register_slot("v", lambda bs, nt: (2,), I32, "none", copy_from_fb=False,
                              value_from_sizes=lambda ctx: 10 * ctx.raw_bs + ctx.padded_bs)  # fmt: skip
    slot_(reg, "x", dtype=I32)
    reg.fill_from({"x": rand(3, I32)}, ctx_(3, 5))  # planned
    assert value.buffer.tolist() == [35, 35]
    reg.fill_from({"x": rand(2, torch.int16)}, ctx_(2, 4))  # a widening cast: the checked path
    assert value.buffer.tolist() == [24, 24]


def test_foreach_failure_falls_back_to_per_tensor_copies(monkeypatch, caplog):
    def broken(dsts, srcs, *args, **kw):
        raise RuntimeError("mixed-device group")

    monkeypatch.setattr(torch, "_foreach_copy_", broken)  # what internals/foreach_copy.py calls
    reg = decode_()
    sources = _decode_sources(3)
    with caplog.at_level(logging.DEBUG, logger="sgl_piecewise.graphs.buffer_registry"):
        reg.fill_from(sources, FillContext.uniform(3, 4))
        reg.fill_from(sources, FillContext.uniform(3, 4))
    for name in ("input_ids", "seq_lens", "out_cache_loc"):
        assert torch.equal(reg.get_slot(name).buffer[:3].long(), sources[name].long())
    # 2 dtype groups x 2 fills fell back; warned once, then at debug level.
    assert reg.stats.per_tensor_fallbacks == 4 and reg.stats.foreach_copies == 0
    assert "RuntimeError: mixed-device group" in reg.stats.last_fallback_reason
    assert [r.levelno for r in caplog.records] == [logging.WARNING] + [logging.DEBUG] * 3


def test_a_torch_without_foreach_copy_is_copied_per_tensor(monkeypatch):
    monkeypatch.setattr(foreach_copy, "AVAILABLE", False)
    reg = decode_()
    sources = _decode_sources(3)
    reg.fill_from(sources, FillContext.uniform(3, 4))
    for name in ("input_ids", "seq_lens", "out_cache_loc"):
        assert torch.equal(reg.get_slot(name).buffer[:3].long(), sources[name].long())
    assert reg.stats.per_tensor_fallbacks == 2 and reg.stats.foreach_copies == 0
    assert "NotImplementedError" in reg.stats.last_fallback_reason


@pytest.mark.gpu
def test_a_dtype_without_a_cuda_foreach_copy_is_copied_per_tensor():
    # CUDA's _foreach_copy_ has no uint32 kernel; copy_ has.
    reg = CudaGraphBufferRegistry(MAX_BS, MAX_TOKENS, "cuda")
    slot = reg.register_slot("x", rows, torch.uint32, "bs")
    src = torch.arange(3, device="cuda").to(torch.uint32)
    reg.fill_from({"x": src}, ctx_(3, 4))
    assert slot.buffer[:3].cpu().tolist() == [0, 1, 2]
    assert reg.stats.per_tensor_fallbacks == 1 and "UInt32" in reg.stats.last_fallback_reason


# ---- property ----------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(
    policy=st.sampled_from(COPYING),
    padded=st.integers(0, MAX_BS),
    data=st.data(),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_head_is_the_source_and_tail_is_the_policy_value(policy, padded, data, seed):
    raw = data.draw(st.integers(0, padded))
    gen = torch.Generator().manual_seed(seed)
    reg = reg_()
    slot = slot_(reg, policy=policy, dtype=I32)
    before = torch.randint(-100, 100, (MAX_BS,), generator=gen, dtype=I32)
    slot.buffer.copy_(before)
    src = torch.randint(-100, 100, (raw,), generator=gen, dtype=I32)
    reg.fill_from({"x": src}, ctx_(raw, padded))
    tail = {P.FILL_SENTINEL: -7, P.ZERO: 0}.get(policy)  # None: left as it was
    want_tail = before[raw:padded] if tail is None else torch.full((padded - raw,), tail)
    assert torch.equal(slot.buffer[:raw], src.to(I32))
    assert torch.equal(slot.buffer[raw:padded], want_tail.to(I32))
    assert torch.equal(slot.buffer[padded:], before[padded:])
