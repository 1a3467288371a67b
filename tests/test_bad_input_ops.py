"""Bad settings and devices given to the attention ops are refused where the
op is entered, before any kernel runs or any K/V is written, with an
``expected …, got …`` message; eager, through the dispatcher, between
compiled pieces and while tracing alike."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from sgl_piecewise import ForwardMode, InvalidInputError, KVPool, ReqToTokenPool, forward_context
from sgl_piecewise.backends import create_backend
from sgl_piecewise.engine.testing import random_batch
from sgl_piecewise.ops import unified_attention, unified_attention_with_output
from sgl_piecewise.ops.attention import attention_with_output_direct

HQ, HKV, D, LAYERS = 4, 2, 8, 2
BACKENDS = ["reference", "torch", "triton"]
NON_FINITE = [float("nan"), float("inf"), float("-inf")]


def make_backend(name: str, device: str = "cpu"):
    if name == "triton":
        pytest.importorskip("triton")
    table = ReqToTokenPool(max_reqs=8, max_context_len=64)
    pool = KVPool(num_slots=256, num_layers=LAYERS, num_kv_heads=HKV, head_dim=D, device=device)
    return create_backend(name, table, pool, num_q_heads=HQ)


def ready(name: str):
    """A backend with the metadata of a fresh ragged EXTEND batch."""
    backend = make_backend(name)
    batch = random_batch(ForwardMode.EXTEND, backend.req_to_token_pool, backend.kv_pool, [0, 6, 2], [3, 1, 5])
    backend.init_forward_metadata(batch)
    return batch, backend


def qkv(n: int, device: str = "cpu"):
    return (
        torch.randn(n, HQ, D, device=device),
        torch.randn(n, HKV, D, device=device),
        torch.randn(n, HKV, D, device=device),
    )


def snapshot(backend):
    pool = backend.kv_pool
    return [t.clone() for t in pool.k_buffers + pool.v_buffers]


def assert_unchanged(backend, before):
    after = snapshot(backend)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a refused call wrote K/V"


def call_every_way(q, k, v, layer_id, scale):
    """The functional op, its out variant, both through the dispatcher
    without the Python wrappers, and the attention between compiled pieces."""
    out = torch.empty_like(q)
    yield lambda: unified_attention(q, k, v, layer_id=layer_id, scale=scale)
    yield lambda: unified_attention_with_output(q, k, v, out, layer_id=layer_id, scale=scale)
    yield lambda: torch.ops.sgl_piecewise.unified_attention(q, k, v, layer_id, scale)
    yield lambda: torch.ops.sgl_piecewise.unified_attention_with_output(q, k, v, out, layer_id, scale)
    yield lambda: attention_with_output_direct(q, k, v, out, layer_id, scale)


# ---- scale --------------------------------------------------------------------
@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("scale", NON_FINITE, ids=repr)
def test_a_non_finite_scale_is_refused_before_any_kv_is_written(name, scale):
    batch, backend = ready(name)
    q, k, v = qkv(batch.num_tokens)
    before = snapshot(backend)
    with forward_context(batch, backend):
        for call in call_every_way(q, k, v, 1, scale):
            with pytest.raises(InvalidInputError, match=rf"scale: expected a finite attention scale, got {scale!r}"):
                call()
    assert_unchanged(backend, before)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("scale", [0.0, -0.125, -1])
def test_a_scale_that_is_not_positive_is_refused(name, scale):
    batch, backend = ready(name)
    q, k, v = qkv(batch.num_tokens)
    before = snapshot(backend)
    with forward_context(batch, backend):
        for call in call_every_way(q, k, v, 0, scale):
            with pytest.raises(InvalidInputError, match=rf"scale: expected a positive attention scale, got {scale!r}"):
                call()
    assert_unchanged(backend, before)


@pytest.mark.parametrize("name", BACKENDS)
def test_a_finite_positive_scale_and_none_still_attend(name):
    batch, backend = ready(name)
    q, k, v = qkv(batch.num_tokens)
    with forward_context(batch, backend):
        default = unified_attention(q, k, v, layer_id=0)
        explicit = unified_attention(q, k, v, layer_id=0, scale=D**-0.5)
        integral = unified_attention(q, k, v, layer_id=0, scale=1)
    assert torch.isfinite(default).all() and torch.isfinite(integral).all()
    torch.testing.assert_close(default, explicit)


@pytest.mark.parametrize("scale", [float("nan"), 0.0])
def test_the_fake_implementations_refuse_the_scale_the_real_ones_refuse(scale):
    """Tracing sees the same refusal as the first real step would."""
    with FakeTensorMode():
        q, k, v = qkv(5)
        out = torch.empty_like(q)
        with pytest.raises(InvalidInputError, match="attention scale"):
            torch.ops.sgl_piecewise.unified_attention(q, k, v, 0, scale)
        with pytest.raises(InvalidInputError, match="attention scale"):
            torch.ops.sgl_piecewise.unified_attention_with_output(q, k, v, out, 0, scale)
        assert torch.ops.sgl_piecewise.unified_attention(q, k, v, 0, 0.5).shape == (5, HQ, D)


def test_a_compiled_call_with_a_non_finite_scale_is_refused_and_a_finite_one_traces_whole(fresh_dynamo):
    batch, backend = ready("reference")
    q, k, v = qkv(batch.num_tokens)

    def finite(q, k, v):
        return unified_attention(q, k, v, layer_id=0, scale=0.25)

    def infinite(q, k, v):
        return unified_attention(q, k, v, layer_id=0, scale=float("inf"))

    with forward_context(batch, backend):
        got = torch.compile(finite, backend="eager", fullgraph=True)(q, k, v)
        torch.testing.assert_close(got, finite(q, k, v))
        with pytest.raises(InvalidInputError, match="scale: expected a finite attention scale, got inf"):
            torch.compile(infinite, backend="eager")(q, k, v)


# ---- device -------------------------------------------------------------------
@pytest.mark.parametrize("name", BACKENDS)
def test_meta_q_k_v_over_a_cpu_pool_are_refused_naming_both_devices(name):
    batch, backend = ready(name)
    q, k, v = qkv(batch.num_tokens, device="meta")
    out = torch.empty_like(q)
    before = snapshot(backend)
    calls = [
        lambda: unified_attention(q, k, v, layer_id=0),
        lambda: unified_attention_with_output(q, k, v, out, layer_id=0),
        lambda: torch.ops.sgl_piecewise.unified_attention(q, k, v, 1, None),
        lambda: attention_with_output_direct(q, k, v, out, 0),
    ]
    with forward_context(batch, backend):
        for call in calls:
            with pytest.raises(InvalidInputError, match="k: expected device cpu, got meta"):
                call()
    assert_unchanged(backend, before)


def test_a_meta_call_is_checked_against_the_pool_like_a_real_one():
    """Not only the device: a meta call gets every check of the real path."""
    batch, backend = ready("reference")
    meta_pool = KVPool(num_slots=8, num_layers=1, num_kv_heads=HKV, head_dim=D, device="meta")
    over_meta = create_backend("reference", backend.req_to_token_pool, meta_pool)
    q, k, v = qkv(batch.num_tokens, device="meta")
    # check=False: reach the op's checks (the context would refuse the CPU batch first).
    with forward_context(batch, over_meta, check=False):
        with pytest.raises(InvalidInputError, match=r"layer_id: expected an int in \[0, 1\), got 1"):
            unified_attention(q, k, v, layer_id=1)
        with pytest.raises(InvalidInputError, match="expected at least the batch's"):
            unified_attention(q[:-1], k[:-1], v[:-1], layer_id=0)
        assert unified_attention(q, k, v, layer_id=0).device.type == "meta"  # a meta pool: as before


def test_a_meta_call_outside_a_forward_context_stays_a_shape_computation():
    q, k, v = qkv(3, device="meta")
    out = unified_attention(q, k, v, layer_id=0)
    assert out.device.type == "meta" and out.shape == (3, HQ, D)


def test_fake_tensors_on_the_pools_device_trace_without_reading_the_context():
    """torch.compile's fake tensors are never checked against the pool: the
    real call checks at run time."""
    batch, backend = ready("reference")
    with forward_context(batch, backend), FakeTensorMode():
        q, k, v = qkv(batch.num_tokens + 4)  # a padded trace, any token count
        assert torch.ops.sgl_piecewise.unified_attention(q, k, v, 1, None).shape == (batch.num_tokens + 4, HQ, D)
