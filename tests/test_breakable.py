"""``BreakableCudaGraphRunner``: the eager model captured in graph segments
broken at every attention call, attention run eagerly between them.

On a CPU the segments are a pass-through, so these tests check everything
around them — the segment/break structure, the registry fill, attention on
the real tokens with the step's metadata, the K/V written, the path checks —
against eager on fresh random batches. The GPU tests repeat them with real
CUDA graphs.
"""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch

import sgl_piecewise as sp
from sgl_piecewise.backends import ReferenceBackend, create_backend
from sgl_piecewise.compile import CompileOptions, counters
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.engine.testing import random_batch, release_batch
from sgl_piecewise.errors import SglPiecewiseError, UnsupportedModeError
from sgl_piecewise.graphs.capture import explain_capture_failure
from sgl_piecewise.models import ModelConfig, build_random_model
from sgl_piecewise.runners.breakable import BreakableCudaGraphRunner
from sgl_piecewise.runners.piecewise import PiecewiseCudaGraphRunner

VOCAB = 101
LAYERS = 2
CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=128,
)
SIZES = (1, 2, 4, 8, 16)


class BranchingModel(torch.nn.Module):
    """A model Dynamo cannot trace as one graph: a Python branch on a
    tensor's value after every layer (never taken for these weights)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, positions):
        m = self.inner.model
        x = m.embed_tokens(input_ids)
        for layer in m.layers:
            x = layer(positions, x, m.rotary_emb)
            if x.abs().amax() > 1e4:  # reads the value: Dynamo breaks here
                x = x.clamp(-1e4, 1e4)
        return m.norm(x)

    def compute_logits(self, hidden):
        return self.inner.compute_logits(hidden)


@torch._dynamo.disable
def _opaque_copy(x: torch.Tensor) -> torch.Tensor:
    """Stands for a call Dynamo refuses (a library kernel it cannot trace)."""
    return x + 0.0


class OpaqueCallModel(BranchingModel):
    """Untraceable as one graph without reading the device: a call Dynamo refuses."""

    def forward(self, input_ids, positions):
        m = self.inner.model
        x = m.embed_tokens(input_ids)
        for layer in m.layers:
            x = _opaque_copy(layer(positions, x, m.rotary_emb))
        return m.norm(x)


def _model(device="cpu", dtype=torch.float32, config=CONFIG):
    return build_random_model(config, dtype, device, seed=5, std=0.2)


# Off CUDA the triton decode grid's split axis is max_kv_splits whole (no SM
# count sizes it), one interpreted program per split and (request, kv head).
# A context here holds at most 96 keys and a split 64 (the kernel's
# tokens_per_split), so no request takes more than 2 splits: 2 keeps every
# request's split count (the merge of 2 splits, and the idle second split of
# a 1-split request) at a 32nd of the default 64's programs.
CPU_TRITON_OPTIONS = dict(max_kv_splits=2)


def _backend(name: str, config=CONFIG, device="cpu"):
    if name == "triton":
        pytest.importorskip("triton")
    options = CPU_TRITON_OPTIONS if name == "triton" and torch.device(device).type == "cpu" else {}
    return partial(create_backend, name, num_q_heads=config.num_attention_heads, **options)


def _runners(model, name="torch", sizes=SIZES, **kw):
    """An eager runner and a breakable one over ``model`` (separate pools)."""
    device = next(model.parameters()).device
    kwargs = {"max_reqs": 8, "max_context_len": 96, "backend": _backend(name, model.config, device), **kw}
    eager, graphs = ModelRunner(model, **kwargs), ModelRunner(model, **kwargs)
    return eager, graphs, BreakableCudaGraphRunner(graphs, sizes)


def _batch(runner: ModelRunner, mode, prefix, extend, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return random_batch(mode, runner.req_to_token_pool, runner.kv_pool, prefix, extend,
                        vocab_size=VOCAB, generator=gen)  # fmt: skip


def _eager_on_padded_inputs(runner: ModelRunner, batch, padded: int) -> torch.Tensor:
    """The eager model on the batch's tokens padded to ``padded`` rows with
    zeros: the kernels and shapes the graphs ran, on the real rows."""
    n = batch.num_tokens
    ids = torch.zeros(padded, dtype=torch.int64, device=runner.device)
    positions = torch.zeros_like(ids)
    ids[:n], positions[:n] = batch.input_ids, batch.positions
    runner.backend.init_forward_metadata(batch)
    with torch.no_grad(), sp.forward_context(batch, runner.backend):
        return runner.model(ids, positions)[:n]


def _random_step(rng: random.Random, mode, bs: int):
    extend = [1] * bs if mode == sp.ForwardMode.DECODE else [rng.randint(1, 5) for _ in range(bs)]
    if mode == sp.ForwardMode.MIXED:  # prefill chunks and decodes together
        extend = [1 if i % 2 else e for i, e in enumerate(extend)]
    prefix = [rng.choice([0, 1, rng.randint(2, 80)]) for _ in range(bs)]
    return prefix, extend


def _check_replays_equal_eager(eager, graphs, breakable, rng, steps, tol) -> None:
    """Each step, through the breakable graphs and eagerly on the same padded
    inputs: hidden states equal within ``tol`` (0: bit for bit), and the
    K/V written to the two pools equal too."""
    for mode, bs in steps:
        prefix, extend = _random_step(rng, mode, bs)
        seed = rng.randrange(2**31)
        a, b = _batch(eager, mode, prefix, extend, seed), _batch(graphs, mode, prefix, extend, seed)
        padded = breakable.padded_size(b.num_tokens)
        with torch.no_grad():
            got = breakable.replay(b, padded)
        want = _eager_on_padded_inputs(eager, a, padded)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        for layer in range(LAYERS):
            for got_kv, want_kv in ((graphs.kv_pool.k_buffers, eager.kv_pool.k_buffers),
                                    (graphs.kv_pool.v_buffers, eager.kv_pool.v_buffers)):  # fmt: skip
                torch.testing.assert_close(got_kv[layer], want_kv[layer], atol=tol, rtol=tol)
        release_batch(eager.req_to_token_pool, eager.kv_pool, a)
        release_batch(graphs.req_to_token_pool, graphs.kv_pool, b)


E, D, M = sp.ForwardMode.EXTEND, sp.ForwardMode.DECODE, sp.ForwardMode.MIXED
# Token counts at, between and up to the captured sizes; every mode.
STEPS = [(E, 3), (D, 1), (M, 4), (D, 3), (E, 1), (M, 2), (D, 8), (E, 4), (M, 6)]


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_replay_equals_eager_on_the_same_padded_inputs_bit_for_bit(name):
    eager, graphs, breakable = _runners(_model(), name)
    breakable.capture(progress=False)
    _check_replays_equal_eager(eager, graphs, breakable, random.Random(f"breakable-{name}"), STEPS, 0)


def test_a_step_above_the_largest_size_runs_eagerly_with_the_eager_logits_bit_for_bit():
    eager, graphs, breakable = _runners(_model())
    graphs.use_graphs(breakable, progress=False)
    counters.reset()
    for i, (mode, extend) in enumerate([(E, [9, 11]), (M, [1, 15, 1]), (D, [1] * 8)]):  # 20, 17 and 8 tokens
        prefix = [3 * i + j for j in range(len(extend))]
        a, b = _batch(eager, mode, prefix, extend, seed=i), _batch(graphs, mode, prefix, extend, seed=i)
        assert torch.equal(graphs.forward_step(b), eager.forward_step(a))
        release_batch(eager.req_to_token_pool, eager.kv_pool, a)
        release_batch(graphs.req_to_token_pool, graphs.kv_pool, b)
    # 20 and 17 tokens are above the largest size, 16: eager; 8 decode tokens replay at 8.
    assert counters.step_paths == {
        ("eager", "graphs='none'"): 3,  # the eager twin
        ("eager", "EXTEND above the largest breakable size 16"): 1,
        ("eager", "MIXED above the largest breakable size 16"): 1,
        ("breakable", "DECODE 8 -> 8 tokens"): 1,
    }


def test_capture_records_one_segment_more_than_attention_calls():
    _, _, breakable = _runners(_model())
    counters.reset()
    breakable.capture(progress=False)
    for size in SIZES:
        graphs = breakable.graphs[size]
        assert [b.layer_id for b in graphs.breaks] == list(range(LAYERS))
        assert len(graphs.segments) == LAYERS + 1
    # 5 sizes x (2 attention calls + 1) segments.
    assert counters.graphs_captured == 5 * 3


def test_each_replay_replays_every_segment_of_its_size():
    eager, graphs, breakable = _runners(_model())
    breakable.capture(progress=False)
    counters.reset()
    _check_replays_equal_eager(eager, graphs, breakable, random.Random("count"), [(E, 3), (D, 2)], 0)
    assert counters.replays == 2 * 3  # 2 steps x 3 segments


def test_generate_through_breakable_graphs_gives_the_eager_tokens_and_frees_everything():
    eager, graphs, breakable = _runners(_model())
    graphs.use_graphs(breakable, progress=False)
    prompts = [[3, 14, 15, 92], [6], [53, 58, 9, 7, 9, 3, 2]]  # 12 tokens: padded to 16
    free = graphs.kv_pool.available
    want = eager.generate(prompts, 8)
    counters.reset()
    assert graphs.generate(prompts, 8) == want
    # 1 prefill of 12 -> 16 tokens, 7 decode steps of 3 -> 4 tokens.
    assert counters.step_paths == {("breakable", "EXTEND 12 -> 16 tokens"): 1, ("breakable", "DECODE 3 -> 4 tokens"): 7}
    assert graphs.kv_pool.available == free


def test_any_backend_serves_breakable_graphs_even_one_without_graph_hooks():
    """Attention runs eagerly between segments: no capture hook is needed."""
    model = _model()
    eager = ModelRunner(model, max_reqs=4, max_context_len=96, backend=ReferenceBackend)
    graphs = ModelRunner(model, max_reqs=4, max_context_len=96, backend=ReferenceBackend)
    graphs.use_graphs(BreakableCudaGraphRunner(graphs, SIZES), progress=False)
    prompts = [[5, 9, 2], [8, 8, 1, 4, 4]]
    assert graphs.generate(prompts, 5) == eager.generate(prompts, 5)


def test_a_batch_longer_than_its_real_tokens_fills_only_the_real_rows():
    eager, graphs, breakable = _runners(_model())
    breakable.capture(progress=False)
    a = _batch(eager, E, [4, 0], [3, 2], seed=1)
    b = _batch(graphs, E, [4, 0], [3, 2], seed=1)
    pad = lambda t: torch.cat([t, torch.zeros(2, dtype=t.dtype)])  # noqa: E731  (2 padded rows by the caller)
    b.input_ids, b.positions, b.out_cache_loc = pad(b.input_ids), pad(b.positions), pad(b.out_cache_loc)
    with torch.no_grad():
        got = breakable.replay(b, 8)
    assert torch.equal(got, _eager_on_padded_inputs(eager, a, 8))


@pytest.mark.parametrize("untraceable", [BranchingModel, OpaqueCallModel])
def test_an_untraceable_model_runs_breakable_but_piecewise_refuses_it_naming_the_break(untraceable):
    torch._dynamo.reset()
    inner = _model()
    model = untraceable(inner)
    runner = ModelRunner(model, max_reqs=4, max_context_len=96, backend=_backend("torch"))
    cause = "Data-dependent branching" if untraceable is BranchingModel else "torch.compiler.disable"
    piecewise = PiecewiseCudaGraphRunner(runner, CompileOptions(cudagraphs=True, capture_sizes=SIZES))
    with pytest.raises(UnsupportedModeError, match=rf"piecewise graphs: .*graph break: .*{cause}.*test_breakable.py"):
        runner.use_graphs(piecewise, progress=False)
    assert runner.token_graphs is None  # the refused capture installed nothing
    runner.use_graphs(BreakableCudaGraphRunner(runner, SIZES), progress=False)
    eager = ModelRunner(inner, max_reqs=4, max_context_len=96, backend=_backend("torch"))
    prompts = [[5, 9, 2, 7], [3]]
    assert runner.generate(prompts, 6) == eager.generate(prompts, 6)
    assert runner.step_stats[-1].path == "breakable"


class SkippingModel(BranchingModel):
    """Skips its last layer when told to: a Python path that changes after capture."""

    skip_last = False

    def forward(self, input_ids, positions):
        m = self.inner.model
        x = m.embed_tokens(input_ids)
        layers = m.layers[:-1] if self.skip_last else m.layers
        for layer in layers:
            x = layer(positions, x, m.rotary_emb)
        return m.norm(x)


def test_a_replay_whose_python_takes_another_path_than_at_capture_is_refused():
    model = SkippingModel(_model())
    _, graphs, breakable = _runners(model)
    graphs.use_graphs(breakable, progress=False)
    model.skip_last = True
    batch = _batch(graphs, E, [0], [3], seed=0)
    with pytest.raises(SglPiecewiseError, match=r"expected the attention calls captured \(layers \[0, 1\]\), got "
                                                r"the end of the forward after 1"):  # fmt: skip
        graphs.forward_step(batch)


def test_a_forward_that_waits_for_the_device_while_captured_gets_the_cause():
    bare = RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
    explained = explain_capture_failure(bare, "breakable graphs of 8 tokens")
    assert isinstance(explained, UnsupportedModeError)
    assert str(explained).startswith(
        "breakable graphs of 8 tokens: expected a forward that never waits for the device while it is "
        "captured, got 'CUDA error: operation not permitted when stream is capturing'; a Python branch"
    )
    assert explain_capture_failure(RuntimeError("out of memory"), "x") is None
    assert explain_capture_failure(ValueError("is capturing"), "x") is None


# ---- GPU: real CUDA graphs ----------------------------------------------------
GPU_CONFIG = ModelConfig(**{**CONFIG.__dict__, "head_dim": 64, "hidden_size": 256})
GPU_SIZES = (1, 2, 4, 8, 16, 24, 32)
GPU_STEPS = [(E, 3), (D, 1), (M, 5), (D, 7), (E, 6), (M, 8), (D, 16), (E, 2), (M, 3), (D, 24)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch", "triton", "flashinfer"])
def test_gpu_replay_equals_eager_on_the_same_padded_inputs(name):
    """Same kernels on the same shapes: fp32 bit for bit (flashinfer: bf16,
    its prefill kernels take 16-bit inputs only, within its tolerance)."""
    if name == "flashinfer":
        pytest.importorskip("flashinfer")
    dtype = torch.bfloat16 if name == "flashinfer" else torch.float32
    # The largest step decodes 24 requests.
    eager, graphs, breakable = _runners(_model("cuda", dtype, GPU_CONFIG), name, GPU_SIZES, max_reqs=24)
    breakable.capture(progress=False)
    assert all(g is not None for size in GPU_SIZES for g in breakable.graphs[size].segments)
    tol = 0 if dtype == torch.float32 else 5e-2
    for round_ in range(2):  # the second round replays graphs other sizes' replays have run over
        _check_replays_equal_eager(eager, graphs, breakable, random.Random(f"gpu-{name}-{round_}"), GPU_STEPS, tol)


@pytest.mark.gpu
def test_gpu_a_model_dynamo_refuses_runs_through_breakable_graphs():
    inner = _model("cuda", torch.float32, GPU_CONFIG)
    runner = ModelRunner(OpaqueCallModel(inner), max_reqs=8, max_context_len=96, backend="triton")
    runner.use_graphs(BreakableCudaGraphRunner(runner, GPU_SIZES), progress=False)
    eager = ModelRunner(inner, max_reqs=8, max_context_len=96, backend="triton")
    prompts = [[5, 9, 2, 7], [3], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert runner.generate(prompts, 16) == eager.generate(prompts, 16)


@pytest.mark.gpu
def test_gpu_a_branch_on_a_tensor_value_is_refused_at_capture_with_the_cause():
    runner = ModelRunner(BranchingModel(_model("cuda", torch.float32, GPU_CONFIG)), max_reqs=8,
                         max_context_len=96, backend="triton")  # fmt: skip
    with pytest.raises(UnsupportedModeError, match="never waits for the device while it is captured"):
        runner.use_graphs(BreakableCudaGraphRunner(runner, (4,)), progress=False)
    # The failed capture left the device usable: an eager step still runs.
    assert len(runner.generate([[1, 2, 3]], 2)[0]) == 2
