"""``CudaGraphRunner`` in TARGET_VERIFY, DRAFT_EXTEND_V2 and IDLE: replay
equals eager, capture writes what replay writes, ``num_token_non_padded`` is
the local count under a simulated attention-TP split, fallbacks are counted.

On a CPU the graph itself is a pass-through (the registry, the hooks and the
static batch run as on a GPU); the GPU twins capture real CUDA graphs.
"""

from __future__ import annotations

import copy
import random
from functools import partial

import pytest
import torch
from test_backends_differential import VERIFY_WIDTH, pad_for_graph, tree_mask_block
from test_whole_model_runner import CONFIG, VOCAB  # noqa: E402 (the same small model)

from sgl_piecewise import ForwardMode, SpecInfo
from sgl_piecewise.backends import create_backend, lengths
from sgl_piecewise.compile import counters
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.engine.testing import random_batch, release_batch
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError
from sgl_piecewise.graphs.input_registries import compute_local_num_token_non_padded
from sgl_piecewise.memory import DUMMY_SLOT
from sgl_piecewise.models import ModelConfig, build_random_model
from sgl_piecewise.runners.whole_model import CudaGraphRunner

W = VERIFY_WIDTH  # tokens per request of both speculative modes (3)
SPEC_MODES = [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2]
CPU_BACKENDS = ["torch", "triton"]
CONTEXT = 96


def _factory(name: str, config=CONFIG):
    if name in ("triton", "flashinfer"):
        pytest.importorskip(name)
    return partial(create_backend, name, num_q_heads=config.num_attention_heads)


def _runners(name, modes, capture_bs=(1, 2, 4), device="cpu", dtype=torch.float32, config=CONFIG, **graph_kwargs):
    """An eager runner and a graph runner over one model (separate pools)."""
    model = build_random_model(config, dtype, device, seed=7, std=0.2)
    kwargs = dict(max_reqs=12, max_context_len=CONTEXT, backend=_factory(name, config))
    eager, graphs = ModelRunner(model, **kwargs), ModelRunner(model, **kwargs)
    width = W if any(m in SPEC_MODES for m in modes) else None
    runner = CudaGraphRunner(graphs, capture_bs, modes=modes, num_tokens_per_req=width, **graph_kwargs)
    return eager, graphs, runner


def _spec(mode, prefix, rng: random.Random, masked=False, device="cpu") -> SpecInfo:
    bs = len(prefix)
    accept = None
    if mode.is_draft_extend_v2():
        accept = torch.tensor([rng.randint(1, W) for _ in range(bs)], dtype=torch.int32, device=device)
    mask = None
    if masked:
        mask = torch.cat([tree_mask_block(p, W, rng) for p in prefix]).to(device)
    return SpecInfo(num_tokens_per_req=W, accept_lengths=accept, custom_mask=mask)


def _batch(runner: ModelRunner, mode, prefix, spec, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return random_batch(mode, runner.req_to_token_pool, runner.kv_pool, prefix, [W] * len(prefix),
                        vocab_size=VOCAB, spec_info=spec, generator=gen)  # fmt: skip


def _skewed_prefix(rng: random.Random, bs: int):
    """Empty-ish, short and long prefixes in one batch (a verify prefix holds >= 1 token)."""
    return [rng.choice([1, rng.randint(2, 8), rng.randint(40, CONTEXT - W)]) for _ in range(bs)]


def _check_fresh_batches(eager, graphs, mode, sizes, seed, tol, masked=False, reference=None) -> None:
    """Per size, one fresh random step through both runners (same random
    prefix K/V in both pools); logits of every real token must agree, and
    in DRAFT_EXTEND_V2 those of each request's last accepted token too.

    With a float32 ``reference`` runner, the tolerance of each step is the
    larger of ``tol`` and how far eager itself is from the reference."""
    rng = random.Random(seed)
    counters.reset()
    for bs in sizes:
        prefix = _skewed_prefix(rng, bs)
        spec, seed_b = _spec(mode, prefix, rng, masked, eager.device), rng.randrange(2**31)
        steps = [(r, _batch(r, mode, prefix, spec, seed_b)) for r in (eager, graphs, reference) if r is not None]
        (_, a), (_, b) = steps[:2]
        want, got = eager.forward_step(a, every_token=True), graphs.forward_step(b, every_token=True)
        atol = tol if reference is None else max(tol, _distance_to_reference(reference, steps[2][1], want, eager))
        torch.testing.assert_close(got, want, atol=atol, rtol=tol)
        if mode.is_draft_extend_v2():
            # Each request's last accepted token, row accept_lengths[r] - 1 of
            # its block of W, picked from eager's rows: the graph runs again
            # and selects them itself.
            last = [r * W + n - 1 for r, n in enumerate(spec.accept_lengths.tolist())]
            torch.testing.assert_close(graphs.forward_step(b), want[last], atol=atol, rtol=tol)
        for runner, batch in steps:
            release_batch(runner.req_to_token_pool, runner.kv_pool, batch)
    steps = len(sizes) * (2 if mode.is_draft_extend_v2() else 1)
    assert counters.replays == steps and not counters.eager_fallbacks


def _distance_to_reference(reference, batch, want, eager) -> float:
    """Largest gap between ``want`` (eager logits) and the float32 reference
    on the same step, its cached K/V rounded to the eager pool's dtype."""
    for buffers in (reference.kv_pool.k_buffers, reference.kv_pool.v_buffers):
        for layer in buffers:
            layer.copy_(layer.to(eager.kv_pool.dtype))
    truth = reference.forward_step(batch, every_token=True)
    return (want.float() - truth).abs().max().item()


@pytest.mark.parametrize("mode", SPEC_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_replay_equals_eager_on_fresh_ragged_batches_of_every_size(name, mode):
    eager, graphs, runner = _runners(name, [mode])
    graphs.use_graphs(runner, progress=False)
    # Every captured size, and 3 padded to 4 (the graph of 4 replayed twice,
    # for a full and a padded batch); sizes go down and up.
    _check_fresh_batches(eager, graphs, mode, (4, 1, 3, 2), f"spec-graphs-{name}-{mode.name}", 1e-4)


def test_tree_masked_verify_replays_like_eager():
    eager, graphs, runner = _runners("torch", [ForwardMode.TARGET_VERIFY], tree_mask=True)
    graphs.use_graphs(runner, progress=False)
    _check_fresh_batches(eager, graphs, ForwardMode.TARGET_VERIFY, (2, 3, 1, 4), "tree", 1e-4, masked=True)


def test_one_runner_serves_decode_verify_and_draft_extend_side_by_side():
    """The modes share registry buffers (one pool, same width) and the
    backend's static buffers; interleaved steps must not disturb each other."""
    modes = [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2]
    eager, graphs, runner = _runners("torch", modes)
    counters.reset()
    graphs.use_graphs(runner, progress=False)
    assert counters.graphs_captured == 9  # 3 modes x 3 sizes
    for i, mode in enumerate([ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2, ForwardMode.TARGET_VERIFY]):
        _check_fresh_batches(eager, graphs, mode, (3, 1), f"mixed-{i}", 1e-4)
    rng = random.Random("mixed-decode")
    counters.reset()
    prefix = [rng.randint(1, 60) for _ in range(3)]
    a, b = (random_batch(ForwardMode.DECODE, r.req_to_token_pool, r.kv_pool, prefix, [1] * 3, vocab_size=VOCAB,
                         generator=torch.Generator().manual_seed(4)) for r in (eager, graphs))  # fmt: skip
    torch.testing.assert_close(graphs.forward_step(b), eager.forward_step(a), atol=1e-4, rtol=1e-4)
    assert counters.replays == 1


# ---- capture writes what replay writes (upstream SGLang PRs 26665, 22404) -------------
def _registry_views(runner: CudaGraphRunner, mode, bs):
    return {k: v.clone() for k, v in runner.registries[mode].extract(_ctx(runner, mode, bs)).items()}


def _ctx(runner, mode, bs):
    from sgl_piecewise.graphs.buffer_registry import FillContext

    return FillContext.uniform(0, bs, runner.layouts[mode].width)


def _assert_same_bytes(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key].reshape(-1).view(torch.uint8), b[key].reshape(-1).view(torch.uint8)), key


@pytest.mark.parametrize("masked", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("mode", SPEC_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_replay_of_a_real_batch_writes_what_a_capture_of_it_writes(name, mode, masked):
    """Runner A captures bs 4 with dummies, then replays a real batch X of 3
    requests. Backend B (same pools) captures X padded to 4 as a graph
    runner pads it. Every static buffer of A and B must be byte-equal."""
    if masked and not mode.is_target_verify():
        pytest.skip("a tree mask is a TARGET_VERIFY input")
    # As attention-TP rank 1 of 2: the registry writes that rank's count.
    _, graphs, runner = _runners(name, [mode], capture_bs=(4,), tree_mask=masked, attn_tp_size=2, attn_tp_rank=1)
    runner.capture(progress=False)
    rng = random.Random(f"capture-replay-{name}-{mode.name}-{masked}")
    prefix = _skewed_prefix(rng, 3)
    x = _batch(graphs, mode, prefix, _spec(mode, prefix, rng, masked), rng.randrange(2**31))
    runner.replay(x, 4)
    b = create_backend(name, graphs.req_to_token_pool, graphs.kv_pool, num_q_heads=CONFIG.num_attention_heads)
    b.init_cuda_graph_state(4, 4 * W)
    padded = pad_for_graph(x, 4, b.get_cuda_graph_seq_len_fill_value())
    b.init_forward_metadata_capture_cuda_graph(4, 4 * W, padded.req_pool_indices, padded.seq_lens, None, mode,
                                               padded.spec_info)  # fmt: skip
    _assert_same_bytes(graphs.backend.cuda_graph_buffers(), b.cuda_graph_buffers())
    ma, mb = graphs.backend.forward_metadata, b.forward_metadata
    assert (ma.bs, ma.max_q_len, ma.num_tokens, ma.masked) == (mb.bs, mb.max_q_len, mb.num_tokens, mb.masked)
    # The registry padded as the graphs need: fill-value prefix, row 0, the
    # dummy slot for every padded token, position 0; 3 x 3 = 9 real tokens of
    # 12 rows, 6 rows per rank: rank 1 holds rows 6..11, of which 3 are real.
    static = runner._static[(mode, 4)]
    assert static.seq_lens.tolist() == x.seq_lens.tolist() + [1]
    assert static.req_pool_indices.tolist()[3] == 0
    assert static.out_cache_loc.tolist()[9:] == [DUMMY_SLOT] * W and static.positions.tolist()[9:] == [0] * W
    assert int(static.num_token_non_padded) == 3


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_an_idle_replay_writes_exactly_what_its_capture_wrote(name):
    """An idle step is the capture's own batch (every request padding): its
    replay must leave every registry view and backend buffer as the capture did."""
    _, graphs, runner = _runners(name, [ForwardMode.IDLE], capture_bs=(4,), attn_tp_size=2, attn_tp_rank=1)
    graphs.use_graphs(runner, progress=False)
    registry, backend = _registry_views(runner, ForwardMode.IDLE, 4), _clone(graphs.backend.cuda_graph_buffers())
    idle = random_batch(ForwardMode.IDLE, graphs.req_to_token_pool, graphs.kv_pool, [], [])
    counters.reset()
    assert graphs.forward_step(idle).shape == (0, VOCAB)
    assert counters.replays == 1 and not counters.eager_fallbacks
    _assert_same_bytes(_registry_views(runner, ForwardMode.IDLE, 4), registry)
    _assert_same_bytes(_clone(graphs.backend.cuda_graph_buffers()), backend)


def _clone(buffers: dict) -> dict:
    return {k: v.clone() for k, v in buffers.items()}


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, *SPEC_MODES], ids=lambda m: m.name)
def test_num_token_non_padded_is_the_attention_tp_local_count_at_capture_and_replay(mode, rank):
    """Two simulated attention-TP ranks each hold half of a graph's rows.
    Width w = 1 (DECODE) or 3; capture sizes 2 and 4 (bs * w even)."""
    w = 1 if mode.is_decode() else W
    _, graphs, runner = _runners("torch", [mode], capture_bs=(2, 4), attn_tp_size=2, attn_tp_rank=rank)
    graphs.use_graphs(runner, progress=False)
    # Capture batches are all padding: 0 real tokens on either rank.
    assert int(runner.registries[mode].get_slot("num_token_non_padded").buffer) == 0
    seen = []  # what the forward reads at replay
    model = graphs.model
    runner.forward = lambda ids, pos: seen.append(int(_current_num_token_non_padded())) or model(ids, pos)
    rng = random.Random(f"ntnp-{mode.name}-{rank}")
    prefix = [rng.randint(1, 60) for _ in range(3)]
    spec = _spec(mode, prefix, rng) if not mode.is_decode() else None
    gen = torch.Generator().manual_seed(1)
    x = random_batch(mode, graphs.req_to_token_pool, graphs.kv_pool, prefix, [w] * 3, vocab_size=VOCAB,
                     spec_info=spec, generator=gen)  # fmt: skip
    graphs.forward_step(x)
    # 3 requests pad to 4: 3w real rows of 4w; each rank holds 2w rows, so
    # rank 0 has 2w real ones and rank 1 the remaining w.
    want = [2 * w, w][rank]
    assert seen == [want] and want == compute_local_num_token_non_padded(3 * w, 4 * w, 2, rank)


def _current_num_token_non_padded():
    from sgl_piecewise.context import get_forward_context

    return get_forward_context().batch.num_token_non_padded


def test_sizes_whose_tokens_do_not_split_over_the_attention_ranks_are_refused():
    model = build_random_model(CONFIG, seed=0)
    runner = ModelRunner(model, max_reqs=8, backend=_factory("torch"))
    with pytest.raises(InvalidInputError, match=r"divide by attn_tp_size=2, got \[1, 3\]"):
        CudaGraphRunner(runner, (1, 2, 3), modes=[ForwardMode.TARGET_VERIFY], num_tokens_per_req=3, attn_tp_size=2)
    # The default schedule keeps the sizes that split: 3 tokens per request, 2 ranks.
    kept = CudaGraphRunner(runner, modes=[ForwardMode.TARGET_VERIFY], num_tokens_per_req=3, attn_tp_size=2)
    assert kept.capture_bs == [2, 4, 8]


# ---- upstream SGLang PR 26512 through the draft-extend graph ---------------------------
def test_draft_extend_graph_attends_to_new_rows_only_in_the_cache(monkeypatch):
    """A DRAFT_EXTEND_V2 step's new rows are in the cache when attention runs;
    its keys are prefix + new per request. The graph equals eager; the bug
    (keys = seq_lens, the prefix) is far off, so the test can see it."""
    mode = ForwardMode.DRAFT_EXTEND_V2
    eager, graphs, runner = _runners("torch", [mode])
    graphs.use_graphs(runner, progress=False)
    rng = random.Random("pr26512")
    prefix = [50, 2, 9]  # skewed: max(prefix) + max(new) overstates the largest extent
    spec, seed = _spec(mode, prefix, rng), 5
    a, b = _batch(eager, mode, prefix, spec, seed), _batch(graphs, mode, prefix, spec, seed)
    want = eager.forward_step(a, every_token=True)
    torch.testing.assert_close(graphs.forward_step(b, every_token=True), want, atol=1e-4, rtol=1e-4)
    assert graphs.backend.forward_metadata.kv_lens.tolist()[:3] == [53, 5, 12]

    real_kv_lens = lengths.kv_lens
    monkeypatch.setattr(lengths, "kv_lens", lambda m, s, e: s if m == mode else real_kv_lens(m, s, e))
    bug = graphs.forward_step(b, every_token=True)
    assert (bug - want).abs().max().item() > 0.1


# ---- fallbacks ------------------------------------------------------------------
def test_batches_no_graph_fits_run_eagerly_and_are_counted_with_the_reason():
    modes = [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2]
    eager, graphs, runner = _runners("torch", modes, capture_bs=(1, 2))
    graphs.use_graphs(runner, progress=False)
    rng = random.Random("fallbacks")
    counters.reset()
    cases = [
        (ForwardMode.TARGET_VERIFY, [4, 9, 1], [W] * 3, SpecInfo(num_tokens_per_req=W)),  # 3 > 2
        (ForwardMode.TARGET_VERIFY, [4, 9], [2, 2], SpecInfo(num_tokens_per_req=2)),  # width 2, captured 3
        (ForwardMode.DRAFT_EXTEND_V2, [4, 9], [3, 1], SpecInfo(num_tokens_per_req=W)),  # ragged
        (ForwardMode.TARGET_VERIFY, [4, 1], [W] * 2, _spec(ForwardMode.TARGET_VERIFY, [4, 1], rng, masked=True)),
    ]
    for mode, prefix, new, spec in cases:
        a, b = (random_batch(mode, r.req_to_token_pool, r.kv_pool, prefix, new, vocab_size=VOCAB, spec_info=spec,
                             generator=torch.Generator().manual_seed(2)) for r in (eager, graphs))  # fmt: skip
        want = eager.forward_step(a, every_token=True)
        torch.testing.assert_close(graphs.forward_step(b, every_token=True), want, atol=1e-4, rtol=1e-4)
    assert counters.replays == 0
    assert counters.eager_fallbacks == {
        "verify graphs: batch of 3 above the largest captured 2": 1,
        "verify graphs: 2 tokens per request, captured 3": 1,
        "draft-extend graphs: a ragged batch, captured a uniform 3 tokens per request": 1,
        "verify graphs: captured with no tree mask, got the other kind": 1,
    }


def test_steps_of_modes_not_captured_run_eagerly_uncounted():
    eager, graphs, runner = _runners("torch", [ForwardMode.DRAFT_EXTEND_V2])
    graphs.use_graphs(runner, progress=False)
    counters.reset()
    prefix = [4, 9]
    spec = SpecInfo(num_tokens_per_req=W)
    batch = _batch(graphs, ForwardMode.TARGET_VERIFY, prefix, spec, 1)
    assert graphs.forward_step(batch, every_token=True).shape == (2 * W, VOCAB)
    assert counters.replays == 0 and not counters.eager_fallbacks


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(modes=[ForwardMode.EXTEND]), InvalidInputError, "expected distinct modes among"),
        (dict(modes=[ForwardMode.DECODE, ForwardMode.DECODE]), InvalidInputError, "expected distinct modes"),
        (dict(modes=ForwardMode.DECODE), InvalidTypeError, "expected a non-empty sequence of ForwardMode"),
        (dict(modes=[ForwardMode.TARGET_VERIFY]), InvalidInputError, "num_tokens_per_req: expected an int >= 1"),
        (dict(modes=[ForwardMode.DRAFT_EXTEND_V2], num_tokens_per_req=0), InvalidInputError, "got 0"),
        (dict(num_tokens_per_req=4), InvalidInputError, "num_tokens_per_req: expected None without"),
        (dict(tree_mask=True), InvalidInputError, "tree_mask: expected TARGET_VERIFY among the modes"),
        (dict(attn_tp_size=2, attn_tp_rank=2), InvalidInputError, r"attn_tp_rank: expected an int in \[0, 2\)"),
    ],
)
def test_bad_mode_configurations_are_refused_with_the_reason(kwargs, err, match):
    runner = ModelRunner(build_random_model(CONFIG, seed=0), max_reqs=4, backend=_factory("torch"))
    with pytest.raises(err, match=match):
        CudaGraphRunner(runner, (2, 4), **kwargs)
    assert runner.step_graphs is None


# ---- GPU: real CUDA graphs ----------------------------------------------------
GPU_CONFIG = ModelConfig(**{**CONFIG.__dict__, "head_dim": 64, "hidden_size": 256})


@pytest.mark.gpu
@pytest.mark.parametrize("mode", SPEC_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("name", ["torch", "triton", "flashinfer"])
def test_gpu_verify_and_draft_extend_graphs_equal_eager(name, mode):
    if name == "flashinfer":
        pytest.importorskip("flashinfer")
    eager, graphs, runner = _runners(name, [mode], (1, 2, 4), "cuda", torch.bfloat16, GPU_CONFIG)
    graphs.use_graphs(runner, progress=False)
    assert len(runner._graphs) == 3
    # Same kernels, same inputs; launch choices of the padded batch may
    # reorder sums: bf16 tolerance on logits. FlashInfer plans a graph's
    # batch with a split of the keys of its own, so graph and eager sum in
    # different orders: the graph may be as far from eager as eager is from
    # the float32 truth, and no further (on an H200 the gap was at most 40%
    # of eager's own error, and only on requests with long prefixes).
    reference = None
    if name == "flashinfer":
        fp32_model = copy.deepcopy(eager.model).float()
        reference = ModelRunner(fp32_model, max_reqs=12, max_context_len=CONTEXT, backend=_factory("torch", GPU_CONFIG))
    seed = f"gpu-spec-{name}-{mode.name}"
    _check_fresh_batches(eager, graphs, mode, (4, 1, 3, 2), seed, 5e-2, reference=reference)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch", "triton", "flashinfer"])
def test_gpu_idle_graph_replays(name):
    if name == "flashinfer":
        pytest.importorskip("flashinfer")
    _, graphs, runner = _runners(name, [ForwardMode.IDLE], (1, 2), "cuda", torch.bfloat16, GPU_CONFIG)
    graphs.use_graphs(runner, progress=False)
    counters.reset()
    idle = random_batch(ForwardMode.IDLE, graphs.req_to_token_pool, graphs.kv_pool, [], [])
    assert graphs.forward_step(idle).shape == (0, VOCAB) and counters.replays == 1
