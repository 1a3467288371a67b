"""``layers.float32_logits``: the LM head's float32 logits, in one matmul
that writes float32 on CUDA for half-precision models, and as linear plus
a conversion elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sgl_piecewise.models.layers import float32_logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_cpu_the_logits_are_linear_then_float32_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 32, generator=gen).to(dtype)
    weight = torch.randn(100, 32, generator=gen).to(dtype)
    got = float32_logits(hidden[::2], weight)  # rows picked by a stride, as the last tokens are
    assert got.dtype == torch.float32 and got.shape == (3, 100)
    torch.testing.assert_close(got, F.linear(hidden[::2], weight).float(), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_gpu_bf16_logits_are_the_float32_sum_unrounded(rows):
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(2 * rows, 896, device="cuda", generator=gen).to(torch.bfloat16)[::2]
    weight = (torch.randn(4099, 896, device="cuda", generator=gen) / 30).to(torch.bfloat16)
    got = float32_logits(hidden, weight)
    assert got.dtype == torch.float32 and got.shape == (rows, 4099)
    exact = hidden.double() @ weight.double().t()
    # float32 accumulation of 896 products, not rounded to bf16 afterwards:
    # far closer to the exact sum than bf16 logits (a step of 2**-8 relative).
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    rounded = F.linear(hidden, weight).float()
    assert (rounded.double() - exact).abs().max() > (got.double() - exact).abs().max()
    torch.testing.assert_close(got, rounded, rtol=2**-7, atol=1e-6)


@pytest.mark.gpu
def test_gpu_float32_models_keep_linear_bit_for_bit():
    hidden, weight = torch.randn(5, 64, device="cuda"), torch.randn(300, 64, device="cuda")
    torch.testing.assert_close(float32_logits(hidden, weight), F.linear(hidden, weight), rtol=0, atol=0)


@pytest.mark.parametrize(
    "hidden, want",
    [
        (torch.zeros(3, 16), "expected shape [*, 32], got [3, 16]"),  # another width
        (torch.zeros(32), "expected shape [*, 32], got [32]"),  # no row axis
        (torch.zeros(3, 32, dtype=torch.float64), "expected dtype torch.float32, got torch.float64"),
    ],
)
def test_hidden_states_that_do_not_fit_the_head_are_refused_by_name(hidden, want):
    from sgl_piecewise.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"hidden: " + want.replace("[", r"\[").replace("*", r"\*")):
        float32_logits(hidden, torch.zeros(100, 32))
