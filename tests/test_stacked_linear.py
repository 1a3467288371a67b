"""``ops.stacked_linear`` and the compiler pass that writes it: linears of one
input whose weights lie back to back become one matmul, with the result of
one matmul each, and a layout that breaks later still gives that result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sgl_piecewise.compile.stacked_linears import stack_linears
from sgl_piecewise.errors import SglPiecewiseError
from sgl_piecewise.models.transformers_adapter import lay_out_stacked_projections
from sgl_piecewise.ops.linear_stack import one_block, stacked_linear

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _block(*rows: int, cols: int = 7, bias: bool = False):
    """Weights (and biases) of ``rows`` each, views of one block, in order."""
    torch.manual_seed(0)
    weight = torch.randn(sum(rows), cols)
    weights = list(weight.split(rows))
    biases = list(torch.randn(sum(rows)).split(rows)) if bias else []
    return weight, weights, biases


def _separate(x, weights, biases):
    return torch.cat([F.linear(x, w, biases[i] if biases else None) for i, w in enumerate(weights)], dim=-1)


def test_one_block_is_a_view_only_for_parts_back_to_back_in_order():
    weight, weights, _ = _block(3, 5, 2)
    whole = one_block(weights)
    assert whole is not None and whole.data_ptr() == weight.data_ptr() and torch.equal(whole, weight)
    assert one_block([weights[0], weights[2]]) is None  # a gap
    assert one_block([weights[1], weights[0]]) is None  # out of order
    assert one_block([weights[0], weights[1].clone()]) is None  # another storage
    assert one_block([weight[:, :3], weight[:, 3:]]) is None  # not contiguous


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_the_op_equals_one_linear_each_whether_or_not_the_weights_are_one_block(tokens, bias):
    _, weights, biases = _block(9, 3, 3, bias=bias)
    x = torch.randn(tokens, 7)
    want = _separate(x, weights, biases)
    torch.testing.assert_close(stacked_linear(x, weights, biases), want)
    apart = [w.clone() for w in weights]  # each in a storage of its own
    torch.testing.assert_close(stacked_linear(x, apart, [b.clone() for b in biases]), want)
    torch.testing.assert_close(stacked_linear(x.unsqueeze(0), weights, biases), want.unsqueeze(0))  # [1, T, K]


@pytest.mark.parametrize(
    "case, match",
    [
        ("no weights", "at least one weight"),
        ("width", r"weights\[1\]"),
        ("dtype", r"weights\[0\]"),
        ("biases", "no bias or one per weight"),
        ("bias rows", r"biases\[1\]"),
    ],
)
def test_the_op_refuses_what_does_not_fit_naming_the_argument(case, match):
    _, weights, biases = _block(4, 2, bias=True)
    x = torch.randn(3, 7)
    if case == "no weights":
        weights, biases = [], []
    elif case == "width":
        weights = [weights[0], torch.randn(2, 6)]
    elif case == "dtype":
        x = x.double()
    elif case == "biases":
        biases = biases[:1]
    elif case == "bias rows":
        biases = [biases[0], torch.randn(3)]
    with pytest.raises(SglPiecewiseError, match=match):
        stacked_linear(x, weights, biases)


class _ThreeOfOneInput(nn.Module):
    """q/k/v-like projections of one input, their outputs reshaped as a layer would."""

    def __init__(self, view: str = "heads"):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
        self.view = view

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.view == "flat":  # a view no column slice allows
            return q.view(-1), k, v
        return q.view(*x.shape[:-1], 2, 4), k.view(*x.shape[:-1], 1, 4), v


def _compiled_with_the_pass(module):
    made = []

    def backend(gm, example_inputs):
        made.append(stack_linears(gm, example_inputs))
        return gm.forward

    return torch.compile(module, backend=backend, fullgraph=True), made


def _assert_same_outputs(compiled, module, x) -> None:
    with torch.no_grad():
        for got, want in zip(compiled(x), module(x)):
            torch.testing.assert_close(got, want)


def _laid_out_and_compiled(laid_out: bool = True, view: str = "heads"):
    torch.manual_seed(0)
    module = _ThreeOfOneInput(view)
    if laid_out:
        assert lay_out_stacked_projections(module) == 1
    compiled, made = _compiled_with_the_pass(module)
    return module, compiled, made


@pytest.mark.parametrize("laid_out", [True, False])
def test_the_pass_stacks_only_linears_whose_weights_are_one_block_and_keeps_the_result(laid_out):
    module, compiled, made = _laid_out_and_compiled(laid_out)
    _assert_same_outputs(compiled, module, torch.randn(5, 8))
    assert made == [1 if laid_out else 0]


def test_the_pass_leaves_linears_whose_output_a_slice_could_not_be_viewed_as():
    module, compiled, made = _laid_out_and_compiled(view="flat")
    _assert_same_outputs(compiled, module, torch.randn(5, 8))
    assert made == [0]


def test_a_weight_moved_after_the_compile_gives_the_result_of_one_matmul_each():
    module, compiled, made = _laid_out_and_compiled()
    x = torch.randn(5, 8)
    _assert_same_outputs(compiled, module, x)
    with torch.no_grad():
        module.k_proj.weight.copy_(torch.randn(4, 8))  # in place: still one block
    _assert_same_outputs(compiled, module, x)
    module.v_proj.weight.data = torch.randn(4, 8)  # out of the block
    _assert_same_outputs(compiled, module, x)
    assert made == [1]


def test_layout_keeps_values_parameters_and_state_dict_keys():
    torch.manual_seed(0)
    module = _ThreeOfOneInput()
    params = dict(module.named_parameters())
    state = {k: v.clone() for k, v in module.state_dict().items()}
    assert lay_out_stacked_projections(module) == 1
    assert dict(module.named_parameters()) == params  # the same objects
    assert module.state_dict().keys() == state.keys()
    assert all(torch.equal(module.state_dict()[k], v) for k, v in state.items())
    assert one_block([module.q_proj.weight, module.k_proj.weight, module.v_proj.weight]) is not None
    assert one_block([module.q_proj.bias, module.k_proj.bias, module.v_proj.bias]) is not None


def test_layout_skips_groups_that_cannot_share_a_block():
    module = _ThreeOfOneInput()
    module.k_proj = nn.Linear(8, 4, bias=False)  # the others have a bias
    assert lay_out_stacked_projections(module) == 0
    module = _ThreeOfOneInput()
    module.v_proj = nn.Linear(6, 4)  # another input width
    assert lay_out_stacked_projections(module) == 0
