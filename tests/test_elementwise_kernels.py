"""The elementwise kernels (``ops/kernels/elementwise.py``) against the
plain formulas they replace (``ops/projections.py``): rotary embedding and
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
from sgl_piecewise.ops import projections  # noqa: E402
from sgl_piecewise.ops.kernels import elementwise  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
# RMSNorm's mean of squares: float32 sums in another order; a bf16 output may
# then round the other way, by one step (2**-8 relative).
NORM_TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=0, rtol=2**-7)}


def plain_rms_norm(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def plain_rotary(positions, x, cache):
    # On the CPU: the formula, where a CUDA tensor would take the kernel.
    return projections._rotary(positions.cpu(), x.cpu(), cache.cpu()).to(x.device)


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
    assert torch.equal(elementwise.rotary(positions, qk, cache), plain_rotary(positions, qk, cache))
    got, want = elementwise.silu_mul(gate_up), plain_silu_mul(gate_up)
    if device == "cpu":  # the interpreter's exp is numpy's, torch's CPU one vectorised: ulps apart
        torch.testing.assert_close(got, want, atol=0, rtol=2**-20)
    else:
        assert torch.equal(got, want)
    torch.testing.assert_close(
        elementwise.rms_norm(x, weight, 1e-6), plain_rms_norm(x, weight, 1e-6), **NORM_TOL[dtype]
    )
    # The residual add and the norm in one kernel: the bits of the add, then of the norm's own kernel.
    delta = torch.randn(x.shape, device=device).to(dtype)
    total, normed = elementwise.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, elementwise.rms_norm(x + delta, weight, 1e-6))


@pytest.mark.triton_cpu
def test_elementwise_equal_the_plain_formulas_on_cpu():
    """float32 only: the interpreter rounds float32 to bfloat16 by truncating
    (the GPU rounds to nearest, as torch does; its twin checks bfloat16)."""
    _check("cpu", torch.float32)


def test_empty_inputs_give_empty_outputs_of_the_right_shape():
    qk, positions, cache, x, weight, gate_up = _cases("cpu", torch.float32)
    assert elementwise.rotary(positions[:0], qk[:0], cache).shape == (0, *qk.shape[1:])
    assert elementwise.silu_mul(gate_up[:0]).shape == (0, gate_up.shape[1] // 2)
    assert elementwise.rms_norm(x[:0], weight, 1e-6).shape == (0, x.shape[1])
    assert [t.shape for t in elementwise.add_rms_norm(x[:0], x[:0], weight, 1e-6)] == [(0, x.shape[1])] * 2


def test_bad_arguments_are_refused_by_name():
    qk, positions, cache, x, weight, gate_up = _cases("cpu", torch.float32)
    with pytest.raises(InvalidInputError, match=r"weight: expected shape \[96\], got \[95\]"):
        elementwise.rms_norm(x, weight[:95], 1e-6)
    with pytest.raises(InvalidInputError, match=r"weight: expected dtype torch.float32, got torch.bfloat16"):
        elementwise.rms_norm(x, weight.bfloat16(), 1e-6)
    with pytest.raises(InvalidInputError, match=r"delta: expected shape \[7, 96\], got \[6, 96\]"):
        elementwise.add_rms_norm(x, x[:6], weight, 1e-6)
    with pytest.raises(InvalidInputError, match=r"delta: expected dtype torch.float32, got torch.bfloat16"):
        elementwise.add_rms_norm(x, x.bfloat16(), weight, 1e-6)
    with pytest.raises(InvalidInputError, match=r"positions: expected shape \[7\], got \[6\]"):
        elementwise.rotary(positions[:6], qk, cache)
    with pytest.raises(InvalidInputError, match=r"positions: expected dtype torch.int32 or torch.int64"):
        elementwise.rotary(positions.float(), qk, cache)
    with pytest.raises(InvalidInputError, match=r"cos_sin_cache: expected shape \[\*, 64\], got \[50, 32\]"):
        elementwise.rotary(positions, qk, cache[:, :32])
    with pytest.raises(InvalidInputError, match=r"x: expected shape \[\*, \*, \*\], got \[7, 512\]"):
        elementwise.rotary(positions, qk.flatten(1), cache)
    with pytest.raises(InvalidInputError, match=r"silu_mul: expected gate_up \[..., 2F\], got shape \[7, 159\]"):
        elementwise.silu_mul(gate_up[:, :159])


def test_the_model_takes_the_plain_formulas_on_a_cpu_and_under_compile(monkeypatch):
    x = torch.zeros(1)
    assert not elementwise.available(x)  # a CPU tensor
    monkeypatch.setattr(elementwise, "available", lambda t: True)  # as a CUDA tensor would be
    assert elementwise.eager(x)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not elementwise.eager(x)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_equal_the_plain_formulas_on_cuda(dtype):
    _check("cuda", dtype)


@pytest.mark.gpu
def test_eager_greedy_tokens_are_those_of_the_plain_formulas(monkeypatch):
    from sgl_piecewise.engine.runner import ModelRunner
    from sgl_piecewise.models import build_random_model, default_config

    model = build_random_model(default_config(), torch.float32, "cuda", seed=4)
    assert elementwise.eager(torch.zeros(1, device="cuda"))  # the first run takes the fused kernels
    prompts = [[int(t) for t in torch.randint(0, 200, (n,))] for n in (5, 1, 9)]
    fused = ModelRunner(model, max_reqs=4, max_context_len=64).generate(prompts, max_new_tokens=16)
    monkeypatch.setattr(elementwise, "available", lambda x: False)
    plain = ModelRunner(model, max_reqs=4, max_context_len=64).generate(prompts, max_new_tokens=16)
    assert fused == plain
