"""``ModelRunner``: greedy generation over the paged pools, the bookkeeping
of rows and slots, the ``model_forward`` seam, and one error per bad input.

Agreement with Hugging Face is in ``test_models_hf_parity.py``; here the model
is a tiny seeded random Llama.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounter

from sgl_piecewise.backends import ReferenceBackend
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError, KVPoolExhaustedError
from sgl_piecewise.models import ModelConfig, build_random_model

VOCAB = 97
MAX_POS = 64

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=MAX_POS,
)


@pytest.fixture(scope="module")
def model():
    # std 0.2: wide logits, so greedy choices are far from ties.
    return build_random_model(CONFIG, seed=11, std=0.2)


def _runner(model, **kwargs) -> ModelRunner:
    kwargs = {"max_reqs": 4, "max_context_len": 48, **kwargs}
    return ModelRunner(model, **kwargs)


def _prompts(lens, seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lens]


def _pool_state(runner: ModelRunner) -> tuple[int, int]:
    return runner.kv_pool.available, runner.req_to_token_pool.available


def test_generate_returns_max_new_tokens_ids_per_prompt_and_frees_every_row_and_slot(model):
    runner = _runner(model)
    before = _pool_state(runner)
    out = runner.generate(_prompts([5, 2, 9]), max_new_tokens=6)
    assert [len(t) for t in out] == [6, 6, 6]
    assert all(0 <= t < VOCAB for seq in out for t in seq)
    assert _pool_state(runner) == before


def test_batched_generate_equals_each_prompt_generated_alone(model):
    runner = _runner(model)
    prompts = _prompts([7, 1, 12, 3], seed=1)
    together = runner.generate(prompts, max_new_tokens=8)
    alone = [runner.generate([p], max_new_tokens=8)[0] for p in prompts]
    assert together == alone


def test_each_request_stops_at_its_eos_and_frees_its_row_and_slots_at_once(model):
    """Requests finish at different steps: each output is the plain run's cut
    after its first EOS, and a finished request's row and slots are back in
    the pools while the others go on."""
    runner = _runner(model)
    prompts = _prompts([5, 2, 9, 4], seed=3)
    plain = runner.generate(prompts, max_new_tokens=10)
    eos = {plain[0][2], plain[2][6]}  # request 0 stops at its 3rd token, request 2 by its 7th at most

    def cut(seq):
        first = next((n for n, t in enumerate(seq) if t in eos), len(seq) - 1)
        return seq[: first + 1]

    freed_rows = []
    free_rows = runner.req_to_token_pool.free
    runner.req_to_token_pool.free = lambda rows: (
        freed_rows.append((len(runner.step_stats), list(rows))),
        free_rows(rows),
    )
    before = _pool_state(runner)
    runner.step_stats.clear()
    out = runner.generate(prompts, max_new_tokens=10, eos_token_ids=eos)
    assert out == [cut(seq) for seq in plain]
    assert _pool_state(runner) == before
    # Request 0 is freed right after the step that made its EOS (its 3rd token:
    # the prefill and 2 decode steps), before the run's last step.
    first_step, first_rows = freed_rows[0]
    assert len(first_rows) == 1 and first_step == len(out[0]) < len(runner.step_stats)
    # The decode batches shrink as requests finish.
    sizes = [s.batch_size for s in runner.step_stats]
    assert sizes[0] == 4 and sizes[-1] < 4 and sizes == sorted(sizes, reverse=True)


def _eos_run(runner: ModelRunner, plain: list[list[int]], prompts) -> list[int]:
    """Batch sizes of each step of a run where request 0 stops at its 3rd token."""
    runner.step_stats.clear()
    out = runner.generate(prompts, max_new_tokens=6, eos_token_ids={plain[0][2]})
    assert out[0] == plain[0][: plain[0].index(plain[0][2]) + 1]
    return [s.batch_size for s in runner.step_stats]


def test_a_request_that_reaches_its_eos_rides_along_one_more_step_whose_token_is_dropped(model):
    """Each step is queued before the one before it is read: the step after an
    EOS is already on its way, so the request's next batch holds it once more."""
    runner = _runner(model)
    prompts = _prompts([5, 2, 9], seed=4)
    plain = runner.generate(prompts, max_new_tokens=6)
    assert plain[0][2] not in plain[0][:2]
    before = _pool_state(runner)
    sizes = _eos_run(runner, plain, prompts)
    # prefill and decodes 1, 2 (the EOS) and 3 (queued before the EOS was read) hold all three
    assert sizes[:4] == [3, 3, 3, 3] and set(sizes[4:]) == {2}
    assert _pool_state(runner) == before


def test_a_backend_that_cannot_prepare_ahead_waits_for_each_step(model):
    """``prepares_ahead=False``: each step is read before the next is built, so no request rides along."""

    def waiting_backend(req_pool, kv_pool):
        backend = ReferenceBackend(req_pool, kv_pool)
        backend.prepares_ahead = False
        return backend

    runner = _runner(model, backend=waiting_backend)
    prompts = _prompts([5, 2, 9], seed=4)
    plain = runner.generate(prompts, max_new_tokens=6)
    sizes = _eos_run(runner, plain, prompts)
    assert sizes[:3] == [3, 3, 3] and set(sizes[3:]) == {2}


@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    max_new=st.integers(1, 7),
    eos_picks=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6)), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_any_eos_set_cuts_each_request_after_its_first_eos_and_frees_everything(model, lens, max_new, eos_picks, seed):
    """Queued steps, ride-along steps and early frees give the plain run's
    tokens cut after each request's first EOS, and every row and slot back."""
    runner = _runner(model)
    prompts = _prompts(lens, seed=seed)
    plain = runner.generate(prompts, max_new_tokens=max_new)
    eos = {plain[i % len(plain)][j % max_new] for i, j in eos_picks}
    before = _pool_state(runner)
    out = runner.generate(prompts, max_new_tokens=max_new, eos_token_ids=eos)
    cut = [seq[: next((n + 1 for n, t in enumerate(seq) if t in eos), len(seq))] for seq in plain]
    assert out == cut
    assert _pool_state(runner) == before


@pytest.mark.parametrize("eos, err", [(["2"], InvalidInputError), ([VOCAB], InvalidInputError), (7, InvalidTypeError)])
def test_bad_eos_token_ids_are_refused(model, eos, err):
    with pytest.raises(err, match="eos_token_ids: expected"):
        _runner(model).generate(_prompts([3]), max_new_tokens=2, eos_token_ids=eos)


def test_step_stats_record_one_extend_then_one_decode_per_further_token(model):
    runner = _runner(model)
    runner.generate(_prompts([4, 6]), max_new_tokens=3)
    # prefill of 4 + 6 tokens, then 2 decode steps of one token per request
    got = [(s.mode, s.batch_size, s.num_tokens) for s in runner.step_stats]
    assert got == [("EXTEND", 2, 10), ("DECODE", 2, 2), ("DECODE", 2, 2)]
    assert all(s.seconds > 0 for s in runner.step_stats)


def test_generate_frees_every_row_and_slot_when_a_step_fails(model):
    runner = _runner(model)
    before = _pool_state(runner)
    calls = []

    def fails_on_third_step(input_ids, positions):
        calls.append(input_ids.shape[0])
        if len(calls) == 3:
            raise RuntimeError("step failed")
        return model(input_ids, positions)

    runner.model_forward = fails_on_third_step
    with pytest.raises(RuntimeError, match="step failed"):
        runner.generate(_prompts([3, 5]), max_new_tokens=10)
    assert _pool_state(runner) == before


def test_every_token_logits_score_each_verify_row_and_end_with_the_last_token_logits(model):
    """TARGET_VERIFY needs a logit row per draft: ``every_token`` gives all
    ``num_tokens`` rows, of which each request's last is ``forward_step``'s."""
    from sgl_piecewise import ForwardMode, SpecInfo
    from sgl_piecewise.engine.testing import random_batch

    runner = _runner(model)
    gen = torch.Generator().manual_seed(3)
    table, pool = runner.req_to_token_pool, runner.kv_pool
    batch = random_batch(ForwardMode.TARGET_VERIFY, table, pool, [7, 1, 12], [3, 3, 3], vocab_size=VOCAB,
                         spec_info=SpecInfo(num_tokens_per_req=3), generator=gen)  # fmt: skip
    every = runner.forward_step(batch, every_token=True)
    assert every.shape == (9, VOCAB)
    torch.testing.assert_close(runner.forward_step(batch), every[[2, 5, 8]], rtol=0, atol=1e-5)


def test_backend_factory_gets_the_runner_pools(model):
    made = []

    def factory(req_to_token_pool, kv_pool):
        made.append((req_to_token_pool, kv_pool))
        return ReferenceBackend(req_to_token_pool, kv_pool)

    runner = _runner(model, backend=factory)
    assert made == [(runner.req_to_token_pool, runner.kv_pool)]
    assert runner.generate(_prompts([4]), max_new_tokens=2) == _runner(model).generate(_prompts([4]), max_new_tokens=2)


def test_compiled_model_forward_traces_one_graph_and_never_recompiles(model):
    torch._dynamo.reset()
    counter = CompileCounter()
    runner = _runner(model)
    runner.model_forward = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    eager = _runner(model)
    # Token counts seen: prefills of 11, 3 and 2 tokens, decodes of 2 and 3.
    # (Batches of one decode token are left out: Dynamo specialises size-1
    # dims of graph inputs, which is a property of the caller's compile
    # settings, not of the model.)
    for lens in ([5, 6], [1, 1, 1], [2]):
        prompts = _prompts(lens, seed=len(lens))
        max_new = 4 if len(lens) > 1 else 1
        assert runner.generate(prompts, max_new) == eager.generate(prompts, max_new)
    assert counter.frame_count == 1
    torch._dynamo.reset()


# ---- bad input: a clear error, and the pools exactly as they were ----------


@pytest.fixture
def runner(model):
    runner = _runner(model)
    yield runner
    assert _pool_state(runner) == (runner.kv_pool.num_slots, runner.req_to_token_pool.max_reqs)


def test_empty_prompt_list_is_rejected(runner):
    with pytest.raises(InvalidInputError, match="expected at least one prompt, got an empty list"):
        runner.generate([], max_new_tokens=2)


def test_empty_prompt_is_rejected_by_index(runner):
    with pytest.raises(InvalidInputError, match=r"prompts\[1\]: expected at least one token"):
        runner.generate([[1, 2], []], max_new_tokens=2)


@pytest.mark.parametrize("bad_id", [-1, VOCAB])
def test_token_id_outside_the_vocab_is_rejected(runner, bad_id):
    want = rf"prompts\[0\]: expected token ids in \[0, {VOCAB}\), got {bad_id}"
    with pytest.raises(InvalidInputError, match=want):
        runner.generate([[1, bad_id, 2]], max_new_tokens=2)


@pytest.mark.parametrize("bad_id", [1.0, "3", True, None])
def test_non_int_token_id_is_rejected(runner, bad_id):
    with pytest.raises(InvalidTypeError, match=r"prompts\[0\]: expected int token ids"):
        runner.generate([[1, bad_id]], max_new_tokens=2)


def test_prompt_that_is_not_a_list_is_rejected(runner):
    want = r"prompts\[0\]: expected a list of int token ids, got str"
    with pytest.raises(InvalidTypeError, match=want):
        runner.generate(["hello"], max_new_tokens=2)


@pytest.mark.parametrize("max_new_tokens", [0, -3, 2.0])
def test_max_new_tokens_that_is_not_a_positive_int_is_rejected(runner, max_new_tokens):
    with pytest.raises(InvalidInputError, match="max_new_tokens: expected a positive int"):
        runner.generate([[1]], max_new_tokens=max_new_tokens)


def test_prompt_plus_new_tokens_past_max_context_len_is_rejected(runner):
    # max_context_len is 48: 40 + 8 fits exactly, 40 + 9 does not.
    runner.generate([[1] * 40], max_new_tokens=8)
    want = r"prompt \+ max_new_tokens <= max_context_len \(48\), got 40 \+ 9"
    with pytest.raises(InvalidInputError, match=want):
        runner.generate([[1] * 40], max_new_tokens=9)


def test_max_context_len_past_max_position_embeddings_is_rejected(model):
    want = rf"max_position_embeddings \({MAX_POS}\), got {MAX_POS + 1}"
    with pytest.raises(InvalidInputError, match=want):
        ModelRunner(model, max_context_len=MAX_POS + 1)


def test_kv_pool_exhaustion_raises_before_allocating_anything(model):
    # Two prompts of 10 with 6 new tokens need 2 * (10 + 6 - 1) = 30 slots.
    runner = _runner(model, num_slots=29)
    with pytest.raises(KVPoolExhaustedError, match="expected 30 free slots for this run, got 29"):
        runner.generate(_prompts([10, 10]), max_new_tokens=6)
    assert _pool_state(runner) == (29, 4)
    assert runner.generate(_prompts([10, 9]), max_new_tokens=6)  # 29 slots: fits exactly
    assert _pool_state(runner) == (29, 4)


def test_more_prompts_than_request_rows_raises_before_allocating_anything(model):
    runner = _runner(model, max_reqs=2)
    with pytest.raises(KVPoolExhaustedError, match="expected room for 3 requests, got 2 free"):
        runner.generate(_prompts([1, 1, 1]), max_new_tokens=2)
    assert _pool_state(runner) == (runner.kv_pool.num_slots, 2)


def test_backend_can_be_named_and_gets_the_model_head_count(model):
    runner = _runner(model, backend="torch")
    assert type(runner.backend).__name__ == "TorchGraphBackend"
    reference = _runner(model)
    prompts = _prompts([5, 3])
    assert runner.generate(prompts, 4) == reference.generate(prompts, 4)


@pytest.mark.parametrize(
    "backend, err, match",
    [
        ("tensorrt", InvalidInputError, r"backend: expected one of \['reference', 'torch', 'triton', 'flashinfer'\]"),
        (42, InvalidTypeError, "backend: expected a backend name or a factory"),
        (lambda table, pool: "torch", InvalidTypeError, "backend factory: expected an AttentionBackend, got str"),
    ],
)
def test_a_backend_that_is_neither_a_name_nor_a_factory_is_refused(model, backend, err, match):
    with pytest.raises(err, match=match):
        _runner(model, backend=backend)


def test_step_stats_keep_only_the_most_recent_steps(model, monkeypatch):
    import sgl_piecewise.engine.runner as runner_module

    monkeypatch.setattr(runner_module, "STEP_STATS_MAXLEN", 5)
    runner = _runner(model)
    runner.generate(_prompts([3]), 8)  # 8 steps: 1 EXTEND, 7 DECODE
    assert len(runner.step_stats) == 5
    assert [s.mode for s in runner.step_stats] == ["DECODE"] * 5


def test_kv_pool_is_sized_from_a_memory_budget_and_the_size_is_logged(model, caplog):
    per_slot = 2 * CONFIG.num_hidden_layers * CONFIG.num_key_value_heads * CONFIG.head_dim * 4  # fp32 K and V
    with caplog.at_level("INFO", logger="sgl_piecewise"):
        runner = _runner(model, kv_cache_gib=100 * per_slot / 2**30)
    assert runner.kv_pool.num_slots == 100
    assert "KV pool: 100 slots" in caplog.text and "kv_cache_gib=" in caplog.text


def test_kv_budget_never_takes_more_than_every_request_at_full_length(model):
    runner = _runner(model, kv_cache_gib=1.0)
    assert runner.kv_pool.num_slots == 4 * 48  # max_reqs * max_context_len of _runner


def test_a_request_that_does_not_fit_the_budget_gets_the_pool_error(model):
    per_slot = 2 * CONFIG.num_hidden_layers * CONFIG.num_key_value_heads * CONFIG.head_dim * 4
    runner = _runner(model, kv_cache_gib=10 * per_slot / 2**30)
    with pytest.raises(KVPoolExhaustedError, match="expected 14 free slots for this run, got 10"):
        runner.generate(_prompts([10]), 5)
    assert _pool_state(runner) == (10, 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kv_cache_gib": 1.0, "num_slots": 64}, "expected num_slots or kv_cache_gib, got both"),
        ({"kv_cache_gib": 0}, "kv_cache_gib: expected a positive number, got 0"),
        ({"kv_cache_gib": 1e-12}, "KV budget: expected room for at least one token"),
    ],
)
def test_bad_kv_budgets_are_refused_with_the_reason(model, kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        _runner(model, **kwargs)


@pytest.mark.parametrize(
    "mode, extend, rows",
    [
        ("DECODE", [1, 1, 1], [0, 1, 2]),
        ("TARGET_VERIFY", [3, 3, 3], [2, 5, 8]),  # uniform blocks: a strided view
        ("EXTEND", [2, 4, 1], [1, 5, 6]),  # ragged: gathered on the device
    ],
)
def test_last_token_logits_score_each_requests_last_new_row(model, mode, extend, rows):
    from sgl_piecewise import ForwardMode, SpecInfo
    from sgl_piecewise.engine.testing import random_batch

    runner = _runner(model)
    spec = SpecInfo(num_tokens_per_req=3) if mode == "TARGET_VERIFY" else None
    batch = random_batch(ForwardMode[mode], runner.req_to_token_pool, runner.kv_pool, [7, 1, 12], extend,
                         vocab_size=VOCAB, spec_info=spec)  # fmt: skip
    hidden = torch.randn(sum(extend), CONFIG.hidden_size)
    want = runner.model.compute_logits(hidden[rows])
    torch.testing.assert_close(runner.last_token_logits(hidden, batch), want, rtol=0, atol=1e-6)
