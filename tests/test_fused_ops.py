"""The model's fused eager kernels (``models/fused_ops.py``) against the
plain formulas they replace (``models/layers.py``): rotary embedding and
SiLU·mul give the plain ops' bits, RMSNorm agrees up to the order its sum
of squares adds in, and with the residual add before it, the add's bits
and then its own. On a CPU the kernels run under TRITON_INTERPRET=1; the
``gpu`` twins check the compiled kernels, and that the eager model's greedy
tokens stay those of the plain formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the fused kernels need the `triton` package")

from sgl_piecewise.errors import InvalidInputError  # noqa: E402
from sgl_piecewise.models import fused_ops, layers  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
# RMSNorm's mean of squares: float32 sums in another order; a bf16 output may
# then round the other way, by one step (2**-8 relative).
NORM_TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=0, rtol=2**-7)}


def plain_rms_norm(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def plain_rotary(positions, x, cache):
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    return layers._rotate(x, cos.unsqueeze(1), sin.unsqueeze(1))


def plain_silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _cases(device, dtype):
    """Inputs shaped as the model hands them over, strided where it does."""
    tokens, heads, kv_heads, dim, hidden, ffn = 7, 6, 2, 64, 96, 80
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=device).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)  # a strided view, as in Attention
    positions = torch.randint(0, 50, (tokens,), device=device)
    cache = torch.randn(50, dim, device=device).to(dtype)
    x = torch.randn(tokens, 2 * hidden, device=device).to(dtype)[:, :hidden]  # strided rows
    weight = torch.randn(hidden, device=device).to(dtype)
    gate_up = torch.randn(tokens, 2 * ffn, device=device).to(dtype) * 4
    return qk, positions, cache, x, weight, gate_up


def _check(device, dtype):
    qk, positions, cache, x, weight, gate_up = _cases(device, dtype)
    assert torch.equal(fused_ops.rotary(positions, qk, cache), plain_rotary(positions, qk, cache))
    got, want = fused_ops.silu_mul(gate_up), plain_silu_mul(gate_up)
    if device == "cpu":  # the interpreter's exp is numpy's, torch's CPU one vectorised: ulps apart
        torch.testing.assert_close(got, want, atol=0, rtol=2**-20)
    else:
        assert torch.equal(got, want)
    torch.testing.assert_close(fused_ops.rms_norm(x, weight, 1e-6), plain_rms_norm(x, weight, 1e-6), **NORM_TOL[dtype])
    # The residual add and the norm in one kernel: the bits of the add, then of the norm's own kernel.
    delta = torch.randn(x.shape, device=device).to(dtype)
    total, normed = fused_ops.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, fused_ops.rms_norm(x + delta, weight, 1e-6))


@pytest.mark.triton_cpu
def test_fused_ops_equal_the_plain_formulas_on_cpu():
    """float32 only: the interpreter rounds float32 to bfloat16 by truncating
    (the GPU rounds to nearest, as torch does; its twin checks bfloat16)."""
    _check("cpu", torch.float32)


def test_empty_inputs_give_empty_outputs_of_the_right_shape():
    qk, positions, cache, x, weight, gate_up = _cases("cpu", torch.float32)
    assert fused_ops.rotary(positions[:0], qk[:0], cache).shape == (0, *qk.shape[1:])
    assert fused_ops.silu_mul(gate_up[:0]).shape == (0, gate_up.shape[1] // 2)
    assert fused_ops.rms_norm(x[:0], weight, 1e-6).shape == (0, x.shape[1])
    assert [t.shape for t in fused_ops.add_rms_norm(x[:0], x[:0], weight, 1e-6)] == [(0, x.shape[1])] * 2


def test_bad_arguments_are_refused_by_name():
    qk, positions, cache, x, weight, gate_up = _cases("cpu", torch.float32)
    with pytest.raises(InvalidInputError, match=r"weight: expected shape \[96\], got \[95\]"):
        fused_ops.rms_norm(x, weight[:95], 1e-6)
    with pytest.raises(InvalidInputError, match=r"weight: expected dtype torch.float32, got torch.bfloat16"):
        fused_ops.rms_norm(x, weight.bfloat16(), 1e-6)
    with pytest.raises(InvalidInputError, match=r"delta: expected shape \[7, 96\], got \[6, 96\]"):
        fused_ops.add_rms_norm(x, x[:6], weight, 1e-6)
    with pytest.raises(InvalidInputError, match=r"delta: expected dtype torch.float32, got torch.bfloat16"):
        fused_ops.add_rms_norm(x, x.bfloat16(), weight, 1e-6)
    with pytest.raises(InvalidInputError, match=r"positions: expected shape \[7\], got \[6\]"):
        fused_ops.rotary(positions[:6], qk, cache)
    with pytest.raises(InvalidInputError, match=r"positions: expected dtype torch.int32 or torch.int64"):
        fused_ops.rotary(positions.float(), qk, cache)
    with pytest.raises(InvalidInputError, match=r"cos_sin_cache: expected shape \[\*, 64\], got \[50, 32\]"):
        fused_ops.rotary(positions, qk, cache[:, :32])
    with pytest.raises(InvalidInputError, match=r"x: expected shape \[\*, \*, \*\], got \[7, 512\]"):
        fused_ops.rotary(positions, qk.flatten(1), cache)
    with pytest.raises(InvalidInputError, match=r"silu_mul: expected gate_up \[..., 2F\], got shape \[7, 159\]"):
        fused_ops.silu_mul(gate_up[:, :159])


def test_the_model_takes_the_plain_formulas_on_a_cpu_and_under_compile(monkeypatch):
    x = torch.zeros(1)
    assert not fused_ops.available(x)  # a CPU tensor
    monkeypatch.setattr(fused_ops, "available", lambda t: True)  # as a CUDA tensor would be
    assert fused_ops.eager(x)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not fused_ops.eager(x)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_ops_equal_the_plain_formulas_on_cuda(dtype):
    _check("cuda", dtype)


@pytest.mark.gpu
def test_eager_greedy_tokens_are_those_of_the_plain_formulas(monkeypatch):
    from sgl_piecewise.engine.runner import ModelRunner
    from sgl_piecewise.models import build_random_model, default_config

    model = build_random_model(default_config(), torch.float32, "cuda", seed=4)
    assert fused_ops.eager(torch.zeros(1, device="cuda"))  # the first run takes the fused kernels
    prompts = [[int(t) for t in torch.randint(0, 200, (n,))] for n in (5, 1, 9)]
    fused = ModelRunner(model, max_reqs=4, max_context_len=64).generate(prompts, max_new_tokens=16)
    monkeypatch.setattr(fused_ops, "eager", lambda x: False)
    plain = ModelRunner(model, max_reqs=4, max_context_len=64).generate(prompts, max_new_tokens=16)
    assert fused == plain
