"""Greedy speculative decoding (``sgl_piecewise.engine.speculative``): exactly plain
greedy's tokens in float32 for every kind of draft, with whole-model graphs
for the three step kinds and without; rows and slots all given back, on
error too; bad input refused before anything is allocated.

Every step the loop builds goes through ``ModelRunner.forward_step``, whose
batch validation (device checks included on the CPU) refuses a real token
whose slot is not the one the request table maps at its position, so these
tests also show that the table stays consistent round after round.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from sgl_piecewise import ForwardMode
from sgl_piecewise.compile import counters
from sgl_piecewise.engine.drafts import LayerSkipDraft, build_draft_model, parse_draft_spec, random_draft_model
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.engine.speculative import speculative_generate
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError, KVPoolExhaustedError
from sgl_piecewise.memory import allocate_requests
from sgl_piecewise.models import ModelConfig, build_random_model
from sgl_piecewise.runners.whole_model import CudaGraphRunner

VOCAB = 101
CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=128,
)
CONTEXT = 96
CAPTURE_BS = (1, 2, 4)


@pytest.fixture(scope="module")
def model():
    # std 0.2: wide logits, so greedy choices are far from ties.
    return build_random_model(CONFIG, seed=5, std=0.2)


def _draft_model(kind: str, target):
    return {"self": lambda: target, "self-layers": lambda: LayerSkipDraft(target, 2),
            "random": lambda: random_draft_model(CONFIG, seed=3)}[kind]()  # fmt: skip


def _runner(model, backend="torch", **kwargs) -> ModelRunner:
    kwargs = {"max_reqs": 6, "max_context_len": CONTEXT, **kwargs}
    return ModelRunner(model, backend=backend, **kwargs)


def _install_graphs(target: ModelRunner, draft: ModelRunner, k: int, capture_bs=CAPTURE_BS) -> None:
    """Whole-model graphs for the three step kinds: verify on the target,
    decode and draft extend on the draft (``k + 1`` tokens per request)."""
    target.use_graphs(CudaGraphRunner(target, capture_bs, modes=[ForwardMode.TARGET_VERIFY], num_tokens_per_req=k + 1),
                      progress=False)  # fmt: skip
    draft.use_graphs(CudaGraphRunner(draft, capture_bs, modes=[ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND_V2],
                                     num_tokens_per_req=k + 1), progress=False)  # fmt: skip


def _prompts(rng: random.Random, lens) -> list:
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lens]


def _all_free(*runners: ModelRunner) -> bool:
    return all(r.kv_pool.available == r.kv_pool.num_slots
               and r.req_to_token_pool.available == r.req_to_token_pool.max_reqs for r in runners)  # fmt: skip


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("kind", ["self", "self-layers", "random"])
def test_speculative_tokens_are_plain_greedy_tokens_for_every_draft(model, kind, graphs):
    rng = random.Random(f"spec-{kind}-{graphs}")
    prompts = _prompts(rng, [rng.randint(1, 12) for _ in range(3)])  # ragged: 3 pads to 4 in graphs
    k, new = rng.choice([2, 3, 4]), rng.randint(14, 20)
    want = _runner(model).generate(prompts, new)
    target, draft = _runner(model), _runner(_draft_model(kind, model))
    if graphs:
        _install_graphs(target, draft, k)
    counters.reset()
    out = speculative_generate(target, draft, prompts, new, k)
    assert out.tokens == want
    assert not counters.eager_fallbacks
    assert (counters.replays > 0) == graphs
    assert _all_free(target, draft)
    if kind == "self":
        assert out.stats.acceptance_rate == 1.0
    if kind == "random":  # an unrelated model: right by chance, about 1 in 101 per draft
        assert out.stats.acceptance_rate < 0.1


@pytest.mark.triton_cpu
def test_triton_graphs_give_plain_greedy_tokens_too(model):
    """The triton backend's decode kernel (draft decodes) and extend kernel
    (verify, draft extend) through the graphs; interpreted on a CPU."""
    pytest.importorskip("triton")
    prompts, k, new = [[5, 9, 2], [3, 3, 8, 1, 40, 2]], 2, 6
    want = _runner(model).generate(prompts, new)
    target, draft = _runner(model, "triton"), _runner(LayerSkipDraft(model, 1), "triton")
    _install_graphs(target, draft, k, capture_bs=(4,))  # 2 requests pad to 4
    counters.reset()
    out = speculative_generate(target, draft, prompts, new, k)
    assert out.tokens == want and counters.replays > 0 and not counters.eager_fallbacks
    assert _all_free(target, draft)


def test_the_target_as_its_own_draft_accepts_every_draft_in_the_fewest_rounds(model):
    """Every round yields k + 1 tokens: the first token comes from the
    prefill, the other 11 in ceil(11 / 4) = 3 rounds (4, 4, then 3 of 4)."""
    prompts, k, new = [[5, 9, 2], [17], [3, 3, 8, 1, 40, 2]], 3, 12
    target, draft = _runner(model), _runner(model)
    _install_graphs(target, draft, k)
    counters.reset()
    out = speculative_generate(target, draft, prompts, new, k)
    assert out.tokens == _runner(model).generate(prompts, new)
    assert out.stats.rounds == math.ceil((new - 1) / (k + 1)) == 3
    assert out.stats.acceptance_rate == 1.0 and out.stats.proposed == 3 * k * 3
    # Per round: one verify, k - 1 draft decodes; a draft extend after every
    # round but the last (all requests finish together): 3 + 2 * 3 + 2 = 11.
    assert counters.replays == 11 and not counters.eager_fallbacks


def _reference_acceptance(model, draft_model, prompts, new: int, k: int):
    """``(rounds per request, accepted drafts)`` of greedy speculative decoding
    computed the slow way: each round the draft greedily continues the
    request's tokens so far by ``k`` (its own ``generate``), and the target's
    greedy tokens (``new + k`` of them, as verify scores past the end) decide."""
    greedy = _runner(model).generate(prompts, new + k)
    rounds, accepted = [], 0
    for prompt, want in zip(prompts, greedy):
        out, n = want[:1], 0
        while len(out) < new:
            drafts = _runner(draft_model).generate([prompt + out], k)[0]
            j = next((i for i in range(k) if drafts[i] != want[len(out) + i]), k)
            out, accepted, n = want[: len(out) + j + 1], accepted + j, n + 1
        rounds.append(n)
    return rounds, accepted


@pytest.mark.parametrize("kind", ["self-layers", "random"])
def test_each_round_proposes_the_drafts_own_greedy_continuation(model, kind):
    """The draft's proposals after a partial acceptance come from its last
    accepted row: the accepted counts equal a slow reference's exactly."""
    prompts, k, new = [[5, 9, 2], [17, 4], [3, 3, 8, 1, 40, 2]], 3, 14
    draft_model = _draft_model(kind, model)
    rounds, accepted = _reference_acceptance(model, draft_model, prompts, new, k)
    out = speculative_generate(_runner(model), _runner(draft_model), prompts, new, k)
    assert out.stats.accepted == accepted and out.stats.rounds == max(rounds)
    assert out.stats.proposed == k * sum(rounds)
    if kind == "self-layers":
        assert 0 < accepted < out.stats.proposed  # partial acceptance happened


@pytest.mark.parametrize("new", [1, 2, 5, 6, 9])
def test_requests_that_finish_mid_acceptance_are_truncated_to_max_new_tokens(model, new):
    """k = 3 and an always-accepted draft: a round adds 4 tokens, so 5 and 9
    new tokens end on a round, 2 and 6 cut the last round short."""
    prompts = [[1, 2, 3], [4], [5, 6]]
    target, draft = _runner(model), _runner(model)
    out = speculative_generate(target, draft, prompts, new, 3)
    assert out.tokens == _runner(model).generate(prompts, new)
    assert [len(t) for t in out.tokens] == [new] * 3
    assert _all_free(target, draft)


def test_requests_finishing_in_different_rounds_leave_the_batch_and_graphs_pad_the_rest(model):
    """A layer-skip draft is accepted unevenly, so requests finish apart and
    later steps carry fewer requests (padded to a captured size)."""
    rng = random.Random("uneven")
    prompts = _prompts(rng, [2, 9, 5, 1])
    target, draft = _runner(model), _runner(LayerSkipDraft(model, 2))
    _install_graphs(target, draft, 2)
    sizes = []
    forward_step = target.forward_step
    target.forward_step = lambda batch, **kw: sizes.append(batch.batch_size) or forward_step(batch, **kw)
    out = speculative_generate(target, draft, prompts, 24, 2)
    assert out.tokens == _runner(model).generate(prompts, 24)
    assert sizes[0] == 4 and sizes[-1] < 4 and sizes == sorted(sizes, reverse=True)


def test_rejected_kv_is_never_read_again(model, monkeypatch):
    """Every slot given back gets NaN K/V in every layer; a step that read a
    rejected position's K/V (or any given-back slot before rewriting it)
    would turn its logits to NaN and change the tokens."""
    prompts = [[5, 9, 2, 7], [17], [3, 3, 8, 1, 40, 2]]
    target, draft = _runner(model), _runner(LayerSkipDraft(model, 1))
    _install_graphs(target, draft, 3)
    for runner in (target, draft):
        pool, free = runner.kv_pool, runner.kv_pool.free

        def poisoning_free(slots, pool=pool, free=free):
            free(slots)
            for buf in pool.k_buffers + pool.v_buffers:
                buf[slots.to(buf.device)] = float("nan")

        monkeypatch.setattr(pool, "free", poisoning_free)
    out = speculative_generate(target, draft, prompts, 20, 3)
    assert 0 < out.stats.accepted < out.stats.proposed  # rejections happened
    assert out.tokens == _runner(model).generate(prompts, 20)


@pytest.mark.parametrize("who, after", [("draft", 1), ("draft", 4), ("target", 2)])
def test_every_row_and_slot_is_given_back_when_a_step_fails(model, who, after):
    """The ``after``-th step of one runner raises (1: the draft's prefill)."""
    target, draft = _runner(model), _runner(LayerSkipDraft(model, 2))
    failing = {"target": target, "draft": draft}[who]
    calls, forward_step = [], failing.forward_step

    def step(batch, **kwargs):
        calls.append(batch.forward_mode)
        if len(calls) == after:
            raise RuntimeError("step failed")
        return forward_step(batch, **kwargs)

    failing.forward_step = step
    with pytest.raises(RuntimeError, match="step failed"):
        speculative_generate(target, draft, [[1, 2, 3], [4, 5]], 12, 3)
    assert len(calls) == after
    assert _all_free(target, draft)


def test_a_missing_draft_is_refused(model):
    target = _runner(model)
    with pytest.raises(InvalidTypeError, match="draft: expected a ModelRunner over the draft model, got NoneType"):
        speculative_generate(target, None, [[1, 2]], 4, 2)
    assert _all_free(target)


# ---- bad input: refused before anything is allocated ----------------------------------
def _held(runner: ModelRunner):
    """Somebody else's live request in ``runner``'s pools."""
    rows, _ = allocate_requests(runner.req_to_token_pool, runner.kv_pool, [0], [5])
    return rows


@pytest.mark.parametrize(
    "case, err, match",
    [
        ("k=0", InvalidInputError, "num_draft_tokens: expected a positive int, got 0"),
        ("k=-2", InvalidInputError, "num_draft_tokens: expected a positive int, got -2"),
        ("k=None", InvalidInputError, "num_draft_tokens: expected a positive int, got None"),
        ("vocab", InvalidInputError, r"draft: expected the target's vocabulary \(101 tokens\), got a draft of 64"),
        ("draft context", InvalidInputError, r"draft: expected max_context_len >= 26 \(longest prompt 6 \+ "
                                             r"max_new_tokens 16 \+ 4 for the speculative window\), got 24"),
        ("target context", InvalidInputError, r"target: expected max_context_len >= 25 .* got 24"),
        ("not a runner", InvalidTypeError, "draft: expected a ModelRunner over the draft model, got LlamaForCausalLM"),
        ("same runner", InvalidInputError, "draft: expected a ModelRunner of its own"),
        ("draft slots", KVPoolExhaustedError, "draft KV pool exhausted: expected 47 free slots for this run, "
                                              "got 45 of 50"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_before_anything_is_allocated_or_freed(model, case, err, match):
    """Prompts of 6 and 1 tokens, 16 new, k = 4 (unless the case changes it)."""
    k = {"k=0": 0, "k=-2": -2, "k=None": None}.get(case, 4)
    target = _runner(model, max_context_len=24 if case == "target context" else CONTEXT)
    draft_model = model
    if case == "vocab":
        draft_model = build_random_model(ModelConfig(**{**CONFIG.__dict__, "vocab_size": 64}), seed=1)
    # Draft slots: at most (6 + 16 + 4) + (1 + 16 + 4) = 47 at once; 5 held leave 45 of 50.
    draft_kwargs = {"draft context": dict(max_context_len=24), "draft slots": dict(num_slots=50)}.get(case, {})
    draft = _runner(draft_model, **draft_kwargs)
    held = [_held(target), _held(draft)]
    before = [(r.kv_pool.available, r.req_to_token_pool.available) for r in (target, draft)]
    draft_arg = {"not a runner": model, "same runner": target}.get(case, draft)
    with pytest.raises(err, match=match):
        speculative_generate(target, draft_arg, [[1, 2, 3, 4, 5, 6], [7]], 16, k)
    assert [(r.kv_pool.available, r.req_to_token_pool.available) for r in (target, draft)] == before
    for runner, rows in zip((target, draft), held):  # still held: the refusal freed nothing of theirs
        assert runner.req_to_token_pool.is_allocated(int(rows[0]))
        runner.kv_pool.free(runner.req_to_token_pool.mapped_slots(rows.tolist()))
        runner.req_to_token_pool.free(rows.tolist())


# ---- drafts ---------------------------------------------------------------------
def test_a_layer_skip_draft_shares_the_targets_weights_and_over_every_layer_is_the_target(model):
    full, short = LayerSkipDraft(model, 3), LayerSkipDraft(model, 1)
    assert short.config.num_hidden_layers == 1 and short.config.vocab_size == VOCAB
    assert short.layers[0].self_attn.qkv_proj.weight is model.model.layers[0].self_attn.qkv_proj.weight
    prompts = [[9, 4, 1], [33, 2]]
    assert _runner(full).generate(prompts, 6) == _runner(model).generate(prompts, 6)
    assert _runner(short).kv_pool.num_layers == 1


@pytest.mark.parametrize("bad", [0, 4, 1.5, True])
def test_a_layer_skip_draft_needs_a_layer_count_the_target_has(model, bad):
    with pytest.raises(InvalidInputError, match=r"num_layers: expected an int in \[1, 3\]"):
        LayerSkipDraft(model, bad)


@pytest.mark.parametrize(
    "text, kind, k, layers",
    [("self:4", "self", 4, None), ("self-layers:2:3", "self-layers", 3, 2), ("random:1", "random", 1, None)],
)
def test_draft_specs_parse(model, text, kind, k, layers):
    spec = parse_draft_spec(text)
    assert (spec.kind, spec.num_draft_tokens, spec.num_layers, str(spec)) == (kind, k, layers, text)
    draft = build_draft_model(spec, model)
    assert draft.config.vocab_size == VOCAB and (draft is model) == (kind == "self")


@pytest.mark.parametrize("text", ["self", "self:0", "self:-1", "self-layers:2", "random:x", "eagle:3", "self:2:2"])
def test_bad_draft_specs_are_refused_with_the_spelling(text):
    with pytest.raises(InvalidInputError, match="--draft: expected self:K, self-layers:N:K or random:K"):
        parse_draft_spec(text)


# ---- eager fallback -----------------------------------------------------------------
def test_batches_above_the_largest_graph_fall_back_counted(model):
    """Three requests, graphs up to 2, self draft (all finish together in
    ceil(9 / 3) = 3 rounds, k = 2): every step is a counted fallback — 3
    verifies, 3 x 1 draft decodes, 2 draft extends."""
    prompts, k = [[1, 2], [3], [4, 5, 6]], 2
    target, draft = _runner(model), _runner(model)
    _install_graphs(target, draft, k, capture_bs=(1, 2))
    counters.reset()
    out = speculative_generate(target, draft, prompts, 10, k)
    assert out.tokens == _runner(model).generate(prompts, 10)
    assert counters.replays == 0
    assert counters.eager_fallbacks == {
        "verify graphs: batch of 3 above the largest captured 2": 3,
        "decode graphs: batch of 3 above the largest captured 2": 3,
        "draft-extend graphs: batch of 3 above the largest captured 2": 2,
    }


# ---- GPU: real CUDA graphs ----------------------------------------------------------
GPU_CONFIG = ModelConfig(**{**CONFIG.__dict__, "head_dim": 64, "hidden_size": 256})


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["self", "self-layers", "random"])
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_gpu_speculative_with_graphs_is_plain_greedy_in_float32(name, kind):
    target_model = build_random_model(GPU_CONFIG, torch.float32, "cuda", seed=5, std=0.2)
    draft_model = build_draft_model(parse_draft_spec({"self": "self:3", "self-layers": "self-layers:2:3",
                                                      "random": "random:3"}[kind]), target_model)  # fmt: skip
    rng = random.Random(f"gpu-spec-{name}-{kind}")
    prompts = _prompts(rng, [rng.randint(1, 12) for _ in range(3)])
    want = _runner(target_model, name).generate(prompts, 20)
    target, draft = _runner(target_model, name), _runner(draft_model, name)
    _install_graphs(target, draft, 3)
    counters.reset()
    out = speculative_generate(target, draft, prompts, 20, 3)
    assert out.tokens == want
    assert counters.replays > 0 and not counters.eager_fallbacks
    assert _all_free(target, draft)


@pytest.mark.gpu
def test_gpu_flashinfer_speculative_graphs_replay_and_accept_the_target_itself():
    """FlashInfer's FA2 prefill (verify, draft extend) has no float32 kernel,
    so token equality with plain greedy cannot be exact here (bf16 rounds
    the verify and decode kernels differently). Checked instead: every step
    replays a graph, the target as its own draft is nearly always accepted,
    every request gets its tokens and every slot comes back."""
    pytest.importorskip("flashinfer")
    target_model = build_random_model(GPU_CONFIG, torch.bfloat16, "cuda", seed=5, std=0.2)
    prompts = [[5, 9, 2], [17], [3, 3, 8, 1, 40, 2]]
    target, draft = _runner(target_model, "flashinfer"), _runner(target_model, "flashinfer")
    _install_graphs(target, draft, 3)
    counters.reset()
    out = speculative_generate(target, draft, prompts, 20, 3)
    assert [len(t) for t in out.tokens] == [20] * 3
    assert out.stats.acceptance_rate > 0.8
    assert counters.replays > 0 and not counters.eager_fallbacks
    assert _all_free(target, draft)
