"""The pieces' Inductor pass: a residual add that is also a graph output stays
``mm`` then ``add`` (no cuBLAS ``addmm`` with its copy of the residual), a bias
add stays ``addmm``, and the sum rounds as the eager model's. On a CPU the
pass is pointed at CPU nodes (the library runs it on CUDA nodes only)."""

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

from sgl_piecewise.compile.residual_add import UnfuseResidualAddmm, residual_adds_unfused


def _residual_step(x, w, r):
    # The sum is returned (as a piece returns the residual stream) and normed.
    s = x @ w.t() + r
    return s, s * torch.rsqrt((s * s).mean(-1, keepdim=True) + 1e-6)


def _bias_step(x, w, b):
    return x @ w.t() + b


def _compiled_code(fn, args, devices):
    torch._dynamo.reset()
    with residual_adds_unfused(devices) if devices else inductor_config.patch({}):
        out, code = run_and_get_code(torch.compile(fn, dynamic=True), *args)
    torch._dynamo.reset()
    return out, "\n".join(code)


def test_a_residual_addmm_becomes_mm_then_add_and_rounds_as_eager():
    x, w, r = torch.randn(5, 64), torch.randn(48, 64), torch.randn(5, 48)
    _, code_without = _compiled_code(_residual_step, (x, w, r), None)
    assert "addmm" in code_without  # what the pass is for: Inductor folds this add on its own
    (total, normed), code = _compiled_code(_residual_step, (x, w, r), ("cpu",))
    assert "addmm" not in code and "extern_kernels.mm" in code
    want, want_normed = _residual_step(x, w, r)
    assert torch.equal(total, want)  # the product rounded, then the add: the eager ops' bits
    torch.testing.assert_close(normed, want_normed)


def test_a_bias_addmm_stays_fused():
    x, w, b = torch.randn(5, 64), torch.randn(48, 64), torch.randn(48)
    out, code = _compiled_code(_bias_step, (x, w, b), ("cpu",))
    assert "addmm" in code
    torch.testing.assert_close(out, _bias_step(x, w, b))


def test_the_pass_leaves_other_devices_alone():
    x, w, r = torch.randn(5, 64), torch.randn(48, 64), torch.randn(5, 48)
    _, code = _compiled_code(_residual_step, (x, w, r), ("cuda",))
    assert "addmm" in code


def test_a_post_grad_pass_the_user_set_is_kept():
    class Theirs(UnfuseResidualAddmm):
        pass

    theirs = Theirs(("cpu",))
    with inductor_config.patch(post_grad_custom_post_pass=theirs):
        with residual_adds_unfused():
            assert inductor_config.post_grad_custom_post_pass is theirs
    with residual_adds_unfused():
        assert isinstance(inductor_config.post_grad_custom_post_pass, UnfuseResidualAddmm)
    assert inductor_config.post_grad_custom_post_pass is None


@pytest.mark.parametrize("devices", ["cuda", ("cuda", 0), [None]])
def test_devices_must_be_device_type_names(devices):
    with pytest.raises(TypeError, match=r"devices: expected a tuple of device types"):
        UnfuseResidualAddmm(devices)


def test_the_pass_is_part_of_inductor_s_cache_key():
    assert UnfuseResidualAddmm(("cuda",)).uuid() != UnfuseResidualAddmm(("cpu",)).uuid()
    assert UnfuseResidualAddmm().uuid() == UnfuseResidualAddmm().uuid()


@pytest.mark.gpu
def test_gpu_the_pieces_of_a_llama_add_every_residual_in_a_kernel(fresh_dynamo):
    # Llama has no linear bias: with the pass, no piece calls addmm at all
    # (without it, each of a layer's two residual adds would fold into one).
    import sgl_piecewise as sp
    from sgl_piecewise.engine.runner import ModelRunner
    from sgl_piecewise.engine.testing import random_batch
    from sgl_piecewise.models import ModelConfig, build_random_model

    config = ModelConfig.from_hf_dict(
        dict(architectures=["LlamaForCausalLM"], hidden_size=128, intermediate_size=256, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
             max_position_embeddings=256, rms_norm_eps=1e-5)
    )  # fmt: skip
    model = build_random_model(config, torch.bfloat16, "cuda", seed=0)
    runner = ModelRunner(model, max_reqs=4, max_context_len=64, backend="triton")
    batch = random_batch(sp.ForwardMode.DECODE, runner.req_to_token_pool, runner.kv_pool, [9, 17], [1, 1])
    runner.backend.init_forward_metadata(batch)
    with torch.no_grad(), sp.forward_context(batch, runner.backend):
        want = model(batch.input_ids, batch.positions)
        got, code = run_and_get_code(torch.compile(model, backend="sgl_piecewise"), batch.input_ids, batch.positions)
    code = "\n".join(code)
    assert "extern_kernels.mm(" in code and "extern_kernels.addmm(" not in code
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
