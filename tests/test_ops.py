"""The attention custom ops: registration, fake implementations, KV writes,
padding, and one test per bad-input error."""

import math
from functools import partial

import pytest
import torch

from sgl_piecewise import (
    ForwardMode,
    InvalidInputError,
    KVPool,
    NoForwardContextError,
    ReqToTokenPool,
    forward_context,
)
from sgl_piecewise.backends import ReferenceBackend
from sgl_piecewise.backends.base import AttentionBackend
from sgl_piecewise.engine.testing import random_batch, release_batch
from sgl_piecewise.errors import InvalidTypeError
from sgl_piecewise.memory import DUMMY_SLOT
from sgl_piecewise.ops import unified_attention, unified_attention_with_output

HQ, HKV, D, LAYERS = 4, 2, 8, 2
# Off CUDA the triton decode grid's split axis is max_kv_splits whole (no SM
# count sizes it), one interpreted program per split and (request, kv head).
# The triton tests' contexts hold at most 64 keys, one split's worth (the
# kernel's tokens_per_split): with 2, every request keeps its one split and
# the grid still holds a split program with nothing to do, at a 32nd of the
# default 64's programs.
CPU_MAX_KV_SPLITS = 2


@pytest.fixture
def setup():
    table = ReqToTokenPool(max_reqs=8, max_context_len=64)
    pool = KVPool(num_slots=256, num_layers=LAYERS, num_kv_heads=HKV, head_dim=D)
    backend = ReferenceBackend(table, pool)
    batch = random_batch(ForwardMode.EXTEND, table, pool, [0, 6, 2], [3, 1, 5])
    backend.init_forward_metadata(batch)
    return batch, backend


def qkv(n, dtype=torch.float32):
    return torch.randn(n, HQ, D, dtype=dtype), torch.randn(n, HKV, D, dtype=dtype), torch.randn(n, HKV, D, dtype=dtype)


def test_both_ops_pass_opcheck(setup):
    batch, backend = setup
    q, k, v = qkv(batch.num_tokens)
    with forward_context(batch, backend):
        torch.library.opcheck(torch.ops.sgl_piecewise.unified_attention.default, (q, k, v, 0))
        out = torch.empty_like(q)
        torch.library.opcheck(torch.ops.sgl_piecewise.unified_attention_with_output.default, (q, k, v, out, 1))


def test_op_writes_new_kv_at_out_cache_loc(setup):
    batch, backend = setup
    q, k, v = qkv(batch.num_tokens)
    with forward_context(batch, backend):
        unified_attention(q, k, v, layer_id=1)
    pool = backend.kv_pool
    assert torch.equal(pool.k_buffers[1][batch.out_cache_loc], k)
    assert torch.equal(pool.v_buffers[1][batch.out_cache_loc], v)


def test_out_variant_equals_functional_variant(setup):
    batch, backend = setup
    q, k, v = qkv(batch.num_tokens)
    out = torch.full_like(q, float("nan"))
    with forward_context(batch, backend):
        expected = unified_attention(q, k, v, layer_id=0)
        unified_attention_with_output(q, k, v, out, layer_id=0)
    assert torch.equal(out, expected)


def test_padded_rows_are_zero_and_write_no_kv(setup):
    batch, backend = setup
    n, pad = batch.num_tokens, 5
    q, k, v = qkv(n + pad)
    pool = backend.kv_pool
    before = [b.clone() for b in pool.k_buffers]
    with forward_context(batch, backend):
        out = unified_attention(q, k, v, layer_id=0)
        unpadded = unified_attention(q[:n], k[:n], v[:n], layer_id=0)
    assert torch.equal(out[n:], torch.zeros(pad, HQ, D))
    assert torch.equal(out[:n], unpadded)
    changed = (pool.k_buffers[0] != before[0]).any(dim=(1, 2)).nonzero().flatten()
    assert sorted(changed.tolist()) == sorted(batch.out_cache_loc.tolist())
    assert torch.equal(pool.k_buffers[0][DUMMY_SLOT], before[0][DUMMY_SLOT])


def test_compiled_call_has_no_graph_break_and_no_recompile_across_sizes(setup):
    _, backend = setup
    table, pool = backend.req_to_token_pool, backend.kv_pool

    def f(q, k, v):
        return unified_attention(q * 2, k, v, layer_id=0).sum(-1) + 1

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for i, n in enumerate([3, 5, 9, 17, 2]):
        batch = random_batch(ForwardMode.EXTEND, table, pool, [i], [n])
        backend.init_forward_metadata(batch)
        q, k, v = qkv(n)
        with forward_context(batch, backend):
            if i == 1:  # after the first (dynamic) compile, no size may recompile
                torch.compiler.set_stance("fail_on_recompile")
            try:
                got = compiled(q, k, v)
            finally:
                torch.compiler.set_stance("default")
            torch.testing.assert_close(got, f(q, k, v))


def test_outside_a_forward_context_raises():
    q, k, v = qkv(2)
    with pytest.raises(NoForwardContextError, match="outside a forward context"):
        unified_attention(q, k, v, layer_id=0)


def test_unknown_layer_id_raises(setup):
    batch, backend = setup
    with (
        forward_context(batch, backend),
        pytest.raises(InvalidInputError, match=r"layer_id: expected an int in \[0, 2\), got 7"),
    ):
        unified_attention(*qkv(batch.num_tokens), layer_id=7)


def test_wrong_rank_raises(setup):
    batch, backend = setup
    q, k, v = qkv(batch.num_tokens)
    with (
        forward_context(batch, backend),
        pytest.raises(InvalidInputError, match=r"q: expected shape \[\*, \*, \*\], got"),
    ):
        unified_attention(q.flatten(1), k, v, layer_id=0)


def test_mismatched_token_counts_raise(setup):
    batch, backend = setup
    q, k, v = qkv(batch.num_tokens)
    with forward_context(batch, backend), pytest.raises(InvalidInputError, match="k: expected shape"):
        unified_attention(q, k[:-1], v, layer_id=0)


def test_fewer_rows_than_the_batch_raise(setup):
    batch, backend = setup
    q, k, v = qkv(batch.num_tokens - 1)
    with forward_context(batch, backend), pytest.raises(InvalidInputError, match="expected at least the batch's"):
        unified_attention(q, k, v, layer_id=0)


def test_heads_not_divisible_raise(setup):
    batch, backend = setup
    n = batch.num_tokens
    with forward_context(batch, backend), pytest.raises(InvalidInputError, match="divisible"):
        unified_attention(torch.randn(n, 3, D), torch.randn(n, 2, D), torch.randn(n, 2, D), layer_id=0)


def test_dtype_other_than_the_pool_raises(setup):
    batch, backend = setup
    with (
        forward_context(batch, backend),
        pytest.raises(InvalidInputError, match="k: expected dtype torch.float32, got torch.bfloat16"),
    ):
        unified_attention(*qkv(batch.num_tokens, torch.bfloat16), layer_id=0)


def test_kv_heads_other_than_the_pool_raise(setup):
    batch, backend = setup
    n = batch.num_tokens
    with forward_context(batch, backend), pytest.raises(InvalidInputError, match="k: expected shape"):
        unified_attention(torch.randn(n, 4, D), torch.randn(n, 4, D), torch.randn(n, 4, D), layer_id=0)


def test_device_other_than_the_pool_raises(setup):
    batch, _ = setup
    table = ReqToTokenPool(max_reqs=1, max_context_len=8)
    meta_pool = KVPool(num_slots=8, num_layers=1, num_kv_heads=HKV, head_dim=D, device="meta")
    # check=False: reach the op's own check (the context would refuse the batch first).
    backend = ReferenceBackend(table, meta_pool)
    with (
        forward_context(batch, backend, check=False),
        pytest.raises(InvalidInputError, match="k: expected device meta, got cpu"),
    ):
        unified_attention(*qkv(batch.num_tokens), layer_id=0)
    with pytest.raises(InvalidInputError, match="input_ids: expected device meta"), forward_context(batch, backend):
        pass


def test_wrong_output_shape_raises(setup):
    batch, backend = setup
    q, k, v = qkv(batch.num_tokens)
    with forward_context(batch, backend), pytest.raises(InvalidInputError, match="output: expected shape"):
        unified_attention_with_output(q, k, v, torch.empty(1, HQ, D), layer_id=0)


def test_non_tensor_input_raises(setup):
    batch, backend = setup
    _, k, v = qkv(batch.num_tokens)
    with forward_context(batch, backend), pytest.raises((InvalidTypeError, TypeError, RuntimeError)):
        unified_attention([1.0], k, v, layer_id=0)


@pytest.mark.parametrize("layer_id", [True, 1.0, "1", None])
def test_a_layer_id_that_is_not_an_int_is_refused_before_the_dispatcher(setup, layer_id):
    batch, backend = setup
    before = backend.kv_pool.k_buffers[1].clone()
    with forward_context(batch, backend), pytest.raises(InvalidTypeError, match="layer_id: expected an int, got"):
        unified_attention(*qkv(batch.num_tokens), layer_id=layer_id)
    assert torch.equal(backend.kv_pool.k_buffers[1], before)  # True would have written layer 1


def test_a_scale_that_is_not_a_number_is_refused(setup):
    batch, backend = setup
    with forward_context(batch, backend), pytest.raises(InvalidTypeError, match="scale: expected a float or None"):
        unified_attention(*qkv(batch.num_tokens), layer_id=0, scale="0.1")


def test_attention_between_pieces_checks_the_first_call_of_a_step_and_every_call_under_debug(setup):
    from sgl_piecewise.ops.attention import attention_with_output_direct

    batch, backend = setup
    q, k, v = qkv(batch.num_tokens)
    out = torch.empty_like(q)
    with forward_context(batch, backend), pytest.raises(InvalidInputError, match="output: expected shape"):
        attention_with_output_direct(q, k, v, torch.empty(1, HQ, D), 0)
    with forward_context(batch, backend, debug_checks=True):
        attention_with_output_direct(q, k, v, out, 0)  # the step's first call
        with pytest.raises(InvalidInputError, match="output: expected shape"):
            attention_with_output_direct(q, k, v, torch.empty(1, HQ, D), 1)


@pytest.mark.triton_cpu
@pytest.mark.parametrize("mode, extend", [(ForwardMode.DECODE, [1, 1, 1]), (ForwardMode.EXTEND, [3, 1, 5])])
def test_a_later_layer_takes_the_steps_plan_and_anything_else_the_full_path(mode, extend):
    """Between compiled pieces, a step's later layers launch through the plan
    its first layer built (``ForwardContext.layer_attend``), bit for bit the
    full path's output and K/V; a new fill, another scale or an invalid layer
    index launch nothing through it, and debug checks never take it."""
    from sgl_piecewise.backends.triton_backend import TritonBackend
    from sgl_piecewise.ops.attention import attention_with_output_direct

    table = ReqToTokenPool(max_reqs=8, max_context_len=64)
    pool = KVPool(num_slots=256, num_layers=3, num_kv_heads=HKV, head_dim=D)
    backend = TritonBackend(table, pool, HQ, max_kv_splits=CPU_MAX_KV_SPLITS)
    batch = random_batch(mode, table, pool, [5, 9, 2], extend)
    layers = [qkv(batch.num_tokens) for _ in range(3)]
    full_path_calls, write_kv_and_attend = [], backend.write_kv_and_attend
    backend.write_kv_and_attend = lambda *a: full_path_calls.append(a[4]) or write_kv_and_attend(*a)

    def step(through_plan: bool) -> list:
        backend.init_forward_metadata(batch)
        outs = []
        with forward_context(batch, backend) as ctx:
            for layer, (q, k, v) in enumerate(layers):
                if not through_plan:
                    ctx.layer_attend = None
                outs.append(torch.empty_like(q))
                attention_with_output_direct(q, k, v, outs[-1], layer)
                assert ctx.layer_attend is not None
        return outs + [b.clone() for b in pool.k_buffers + pool.v_buffers]

    full = step(through_plan=False)
    planned = step(through_plan=True)
    assert all(torch.equal(a, b) for a, b in zip(full, planned))
    assert full_path_calls == [0, 1, 2, 0]  # the planned step: its first layer only

    backend.init_forward_metadata(batch)
    q, k, v = layers[1]
    with forward_context(batch, backend) as ctx:
        attention_with_output_direct(q, k, v, torch.empty_like(q), 0)
        attend, untouched = ctx.layer_attend, pool.k_buffers[1].clone()
        scale = 1.0 / math.sqrt(D)  # the op's scale for None, as it hands it over
        assert attend(q, k, v, torch.empty_like(q), 2, scale)  # what the refusals below differ from
        for layer_id, other_scale in ((1, 0.5), (3, scale), (-1, scale), (True, scale)):
            assert not attend(q, k, v, torch.empty_like(q), layer_id, other_scale)
        backend.init_forward_metadata(batch)  # a new fill: the plan is gone
        assert not attend(q, k, v, torch.empty_like(q), 1, scale)
        assert torch.equal(pool.k_buffers[1], untouched)
    with forward_context(batch, backend, debug_checks=True) as ctx:
        attention_with_output_direct(q, k, v, torch.empty_like(q), 0)
        assert ctx.layer_attend is None


@pytest.mark.triton_cpu
@pytest.mark.parametrize("mode, extend", [(ForwardMode.DECODE, [1, 1, 1]), (ForwardMode.EXTEND, [3, 1, 5])])
def test_a_step_of_the_same_sizes_over_bound_metadata_takes_the_last_steps_plan(mode, extend):
    """Eager steps over the static buffers keep their plans: the next step of
    the same sizes launches the last one with its own slots, bit for bit
    what a backend that builds a plan per step gives; slots at an address
    aligned unlike the plan's (its kernels were specialised on it) get a
    new plan."""
    from sgl_piecewise.backends.triton_backend import TritonBackend
    from sgl_piecewise.ops.attention import attention_with_output_direct

    def fresh():
        table = ReqToTokenPool(max_reqs=8, max_context_len=64)
        pool = KVPool(num_slots=256, num_layers=2, num_kv_heads=HKV, head_dim=D)
        return table, pool, TritonBackend(table, pool, HQ, max_kv_splits=CPU_MAX_KV_SPLITS)

    (table, pool, bound), (table2, pool2, per_step) = fresh(), fresh()
    bound.init_cuda_graph_state(max_bs=4, max_num_tokens=16)
    gen, gen2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    plans = []
    for step in range(4):  # each step new requests in new slots; the last one's 8 bytes off 16
        batch = random_batch(mode, table, pool, [5, 9, 2], extend, generator=gen)
        batch2 = random_batch(mode, table2, pool2, [5, 9, 2], extend, generator=gen2)
        if step == 3:
            shifted = torch.empty(batch.out_cache_loc.shape[0] + 1, dtype=torch.int64)
            shifted[1:] = batch.out_cache_loc
            batch.out_cache_loc = shifted[1:]
        layers = [qkv(batch.num_tokens) for _ in range(2)]
        outs = []
        for backend, b in ((bound, batch), (per_step, batch2)):
            backend.init_forward_metadata(b)
            with forward_context(b, backend):
                for layer, (q, k, v) in enumerate(layers):
                    outs.append(torch.empty_like(q))
                    attention_with_output_direct(q, k, v, outs[-1], layer)
        assert all(torch.equal(a, b) for a, b in zip(outs[:2], outs[2:]))
        kv, kv2 = pool.k_buffers + pool.v_buffers, pool2.k_buffers + pool2.v_buffers
        assert all(torch.equal(a, b) for a, b in zip(kv, kv2))
        plans.append(bound.forward_metadata.step_plan.plan)
        release_batch(table, pool, batch)
        release_batch(table2, pool2, batch2)
    assert plans[0] is plans[1] is plans[2]
    assert plans[3] is not plans[0]


@pytest.mark.gpu
@pytest.mark.parametrize("mode, extend", [(ForwardMode.DECODE, [1, 1, 1]), (ForwardMode.EXTEND, [3, 1, 5])])
@pytest.mark.parametrize("pad", [0, 5])
def test_flashinfer_layers_through_the_steps_plan_equal_the_full_path(mode, extend, pad):
    """Between compiled pieces a FlashInfer step's layers go through the plan
    its first layer built (one K/V-write launch, then ``run()``): bit for bit
    the full path's output and K/V (two ``index_copy_``, ``run()``, the
    padded rows zeroed), padded rows zero and writing no K/V, also for a
    layer whose pool buffers were replaced after the backend was built;
    another scale, an invalid layer index or a new fill launch nothing
    through it."""
    pytest.importorskip("flashinfer")
    from sgl_piecewise.backends.flashinfer_backend import FlashInferBackend
    from sgl_piecewise.ops.attention import attention_with_output_direct

    hq, hkv, d = 4, 2, 128  # the FlashInfer kernels the backend tests build
    table = ReqToTokenPool(max_reqs=8, max_context_len=64, device="cuda")
    pool = KVPool(num_slots=256, num_layers=3, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16, device="cuda")
    backend = FlashInferBackend(table, pool, hq)
    batch = random_batch(mode, table, pool, [5, 9, 2], extend)
    rows = batch.num_tokens + pad

    def layer_tensors():
        shapes = ((rows, hq, d), (rows, hkv, d), (rows, hkv, d))
        return [torch.randn(s, dtype=torch.bfloat16, device="cuda") for s in shapes]

    layers = [layer_tensors() for _ in range(3)]
    lean = backend.write_kv_and_attend

    def step(through_plan: bool) -> list:
        # Without a plan: the base class's route, K/V written and then ``forward``.
        backend.write_kv_and_attend = lean if through_plan else partial(AttentionBackend.write_kv_and_attend, backend)
        backend.init_forward_metadata(batch)
        outs = []
        with forward_context(batch, backend) as ctx:
            for layer, (q, k, v) in enumerate(layers):
                outs.append(torch.full_like(q, float("nan")))
                attention_with_output_direct(q, k, v, outs[-1], layer)
                assert (ctx.layer_attend is not None) == through_plan
        return outs + [b.clone() for b in pool.k_buffers + pool.v_buffers]

    untouched = [b.clone() for b in pool.k_buffers + pool.v_buffers]
    full = step(through_plan=False)
    for b, before in zip(pool.k_buffers + pool.v_buffers, untouched):
        b.copy_(before)
    # Layer 0's buffers replaced since the backend was built: its paged views are made anew.
    pool.k_buffers[0], pool.v_buffers[0] = pool.k_buffers[0].clone(), pool.v_buffers[0].clone()
    planned = step(through_plan=True)
    assert all(torch.equal(a, b) for a, b in zip(full, planned))
    assert all(not out[batch.num_tokens :].any() for out in planned[:3])
    written = batch.out_cache_loc.unique().numel()
    for b, before in zip(pool.k_buffers + pool.v_buffers, untouched):  # the real rows' slots, no other
        assert int((b != before).any(dim=(1, 2)).sum()) == written

    backend.init_forward_metadata(batch)
    q, k, v = layers[1]
    with forward_context(batch, backend) as ctx:
        attention_with_output_direct(q, k, v, torch.empty_like(q), 0)
        attend, kept = ctx.layer_attend, pool.k_buffers[1].clone()
        scale = 1.0 / math.sqrt(d)
        assert attend(q, k, v, torch.empty_like(q), 2, scale)
        for layer_id, other_scale in ((1, 0.5), (3, scale), (-1, scale), (True, scale)):
            assert not attend(q, k, v, torch.empty_like(q), layer_id, other_scale)
        backend.init_forward_metadata(batch)  # a new fill: the plan is gone
        assert not attend(q, k, v, torch.empty_like(q), 1, scale)
        assert torch.equal(pool.k_buffers[1], kept)
