"""Inconsistent batches are refused before any kernel runs, with the reason.

Every case builds a valid ragged batch over a live runner, breaks one field
the way a caller building ``ForwardBatch`` by hand could, and checks that the
step is refused with an ``expected …, got …`` message while the KV pool and
the request table stay exactly as they were.
"""

import dataclasses

import pytest
import torch

from sgl_piecewise import ForwardBatch, ForwardMode, InvalidInputError, SpecInfo, forward_context
from sgl_piecewise.batch_checks import check_batch
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.engine.testing import random_batch, release_batch
from sgl_piecewise.models import build_random_model, default_config

CONTEXT = 64


@pytest.fixture(scope="module")
def model():
    return build_random_model(dataclasses.replace(default_config(), num_hidden_layers=2), seed=0)


@pytest.fixture
def runner(model):
    return ModelRunner(model, max_reqs=6, max_context_len=CONTEXT, backend="torch")


def extend_batch(runner, prefix=(5, 0, 9), extend=(3, 4, 1), mode=ForwardMode.EXTEND, spec_info=None):
    return random_batch(mode, runner.req_to_token_pool, runner.kv_pool, list(prefix), list(extend),
                        vocab_size=runner.config.vocab_size, spec_info=spec_info)  # fmt: skip


def snapshot(runner):
    pool = runner.kv_pool
    return [t.clone() for t in pool.k_buffers + pool.v_buffers], runner.req_to_token_pool.req_to_token.clone()


def assert_refused(runner, batch, match):
    before, table = snapshot(runner)
    with pytest.raises(InvalidInputError, match=match):
        runner.forward_step(batch)
    after, table_after = snapshot(runner)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a refused step wrote K/V"
    assert torch.equal(table, table_after)


def test_a_valid_ragged_batch_of_every_mode_passes(runner):
    cases = [
        (ForwardMode.EXTEND, (5, 0, 9), (3, 4, 1), None),
        (ForwardMode.MIXED, (5, 0, 9), (1, 4, 1), None),
        (ForwardMode.DECODE, (5, 0, 9), (1, 1, 1), None),
        (ForwardMode.TARGET_VERIFY, (5, 2, 9), (3, 3, 3), SpecInfo(num_tokens_per_req=3)),
        (ForwardMode.DRAFT_EXTEND_V2, (5, 2, 9), (2, 2, 1), SpecInfo(num_tokens_per_req=2)),
    ]
    for mode, prefix, extend, spec in cases:
        batch = extend_batch(runner, prefix, extend, mode, spec)
        check_batch(batch, runner.req_to_token_pool, runner.kv_pool, debug_checks=True)
        release_batch(runner.req_to_token_pool, runner.kv_pool, batch)


def test_a_row_index_of_minus_one_is_refused(runner):
    batch = extend_batch(runner)
    rows = batch.req_pool_indices.clone()
    rows[1] = -1  # would read the last row of the table
    bad = dataclasses.replace(batch, req_pool_indices=rows, req_pool_indices_cpu=rows.clone())
    assert_refused(runner, bad, r"req_pool_indices: expected rows allocated in the request table \[0, 6\), got \[-1\]")


def test_a_free_request_row_is_refused(runner):
    batch = extend_batch(runner)
    (free_row,) = runner.req_to_token_pool.alloc(1)
    runner.req_to_token_pool.free([free_row])
    rows = torch.tensor([batch.req_pool_indices_cpu[0].item(), free_row, batch.req_pool_indices_cpu[2].item()])
    bad = dataclasses.replace(batch, req_pool_indices=rows, req_pool_indices_cpu=rows.clone())
    assert_refused(runner, bad, "req_pool_indices: expected rows allocated")


def test_a_real_token_given_the_dummy_slot_is_refused(runner):
    batch = extend_batch(runner)
    loc = batch.out_cache_loc.clone()
    loc[2] = 0
    bad = dataclasses.replace(batch, out_cache_loc=loc, out_cache_loc_cpu=loc.clone())
    assert_refused(runner, bad, r"out_cache_loc: expected allocated KV slots in \[1, \d+\] .*got \[0\]")


def test_a_slot_past_the_pool_is_refused(runner):
    batch = extend_batch(runner)
    loc = batch.out_cache_loc.clone()
    loc[0] = runner.kv_pool.num_slots + 5  # an index_copy_ past the buffer: a device-side assert on a GPU
    bad = dataclasses.replace(batch, out_cache_loc=loc, out_cache_loc_cpu=loc.clone())
    assert_refused(runner, bad, "out_cache_loc: expected allocated KV slots")


def test_a_slot_of_another_live_request_is_refused(runner):
    batch = extend_batch(runner)
    other = extend_batch(runner, prefix=(4,), extend=(2,))
    loc = batch.out_cache_loc.clone()
    loc[0] = other.out_cache_loc[0]  # allocated, but it is the other request's cache
    bad = dataclasses.replace(batch, out_cache_loc=loc, out_cache_loc_cpu=loc.clone())
    assert_refused(runner, bad, "out_cache_loc: expected the slots the request table maps")


def test_the_same_slot_for_two_new_tokens_is_refused(runner):
    batch = extend_batch(runner)
    loc = batch.out_cache_loc.clone()
    loc[1] = loc[0]
    bad = dataclasses.replace(batch, out_cache_loc=loc, out_cache_loc_cpu=loc.clone())
    assert_refused(runner, bad, "out_cache_loc: expected a distinct slot per new token")


def test_int32_slots_are_refused_with_the_dtype(runner):
    batch = extend_batch(runner)
    bad = dataclasses.replace(batch, out_cache_loc=batch.out_cache_loc.int())
    assert_refused(runner, bad, "out_cache_loc: expected dtype torch.int64, got torch.int32")


def test_seq_lens_shorter_than_the_new_tokens_are_refused(runner):
    batch = extend_batch(runner)
    short = torch.tensor([1, 1, 1], dtype=torch.int32)
    bad = dataclasses.replace(batch, seq_lens=short, seq_lens_cpu=short.clone())
    assert_refused(
        runner,
        bad,
        r"seq_lens_cpu: expected prefix \+ new tokens per request in EXTEND \(\[8, 4, 10\]\), got \[1, 1, 1\]",
    )


def test_host_lengths_that_disagree_with_the_device_tensors_are_refused(runner):
    batch = extend_batch(runner)
    wrong = batch.seq_lens.clone()
    wrong[0] += 1
    assert_refused(runner, dataclasses.replace(batch, seq_lens=wrong), "seq_lens: expected the values of its host copy")
    wrong = batch.extend_prefix_lens.clone()
    wrong[2] -= 1
    assert_refused(runner, dataclasses.replace(batch, extend_prefix_lens=wrong), "extend_prefix_lens: expected")


def test_positions_that_disagree_with_the_lengths_are_refused(runner):
    batch = extend_batch(runner)
    positions = batch.positions.clone()
    positions[0] += 1
    assert_refused(runner, dataclasses.replace(batch, positions=positions), "positions: expected prefix")


def test_decode_with_several_new_tokens_per_request_is_refused(runner):
    batch = extend_batch(runner)
    assert_refused(runner, dataclasses.replace(batch, forward_mode=ForwardMode.DECODE),
                   r"expected 1 new token\(s\) per request in DECODE, got \[3, 4, 1\]")  # fmt: skip


def test_target_verify_without_a_uniform_width_is_refused(runner):
    batch = extend_batch(runner, prefix=(5, 2), extend=(3, 2), mode=ForwardMode.TARGET_VERIFY,
                         spec_info=SpecInfo(num_tokens_per_req=3))  # fmt: skip
    assert_refused(runner, batch, r"expected 3 new token\(s\) per request in TARGET_VERIFY")
    no_spec = extend_batch(runner, prefix=(1,), extend=(3,), mode=ForwardMode.EXTEND)
    assert_refused(runner, dataclasses.replace(no_spec, forward_mode=ForwardMode.TARGET_VERIFY),
                   "TARGET_VERIFY: expected spec_info.num_tokens_per_req")  # fmt: skip


@pytest.mark.parametrize("accept", [[0, 1, 1], [1, 3, 1], [2, 2]])
def test_draft_extend_accept_lengths_outside_each_block_are_refused(runner, accept):
    """A request's logits come from row ``accept - 1`` of its block: 0 would
    read the previous request's row, 3 of a 2-token block the next one's."""
    spec = SpecInfo(num_tokens_per_req=2, accept_lengths=torch.tensor(accept, dtype=torch.int32))
    batch = extend_batch(runner, (5, 2, 9), (2, 2, 2), ForwardMode.DRAFT_EXTEND_V2, spec)
    assert_refused(runner, batch, "spec_info.accept_lengths: expected")


def test_draft_extend_with_accept_lengths_takes_each_requests_last_accepted_row(runner):
    spec = SpecInfo(num_tokens_per_req=3, accept_lengths=torch.tensor([1, 3, 2], dtype=torch.int32))
    batch = extend_batch(runner, (5, 2, 9), (3, 3, 3), ForwardMode.DRAFT_EXTEND_V2, spec)
    hidden = torch.randn(9, runner.config.hidden_size)
    want = runner.model.compute_logits(hidden[[0, 5, 7]])  # rows 0, 3 + 2, 6 + 1
    assert torch.equal(runner.last_token_logits(hidden, batch), want)


def test_a_negative_prefix_is_refused(runner):
    batch = extend_batch(runner)
    prefix = list(batch.extend_prefix_lens_cpu)
    prefix[1] = -2
    assert_refused(runner, dataclasses.replace(batch, extend_prefix_lens_cpu=prefix),
                   r"extend_prefix_lens_cpu: expected ints >= 0, got \[-2\]")  # fmt: skip


def test_a_prefix_past_the_context_is_refused(runner):
    batch = extend_batch(runner)
    prefix = list(batch.extend_prefix_lens_cpu)
    prefix[0] = CONTEXT
    seq = torch.tensor([p + e for p, e in zip(prefix, batch.extend_seq_lens_cpu)], dtype=torch.int32)
    bad = dataclasses.replace(batch, extend_prefix_lens_cpu=prefix, seq_lens_cpu=seq)
    assert_refused(
        runner,
        bad,
        f"request 0: expected prefix \\+ new tokens <= max_context_len \\({CONTEXT}\\), got {CONTEXT} \\+ 3",
    )


def test_a_batch_size_that_disagrees_with_the_lengths_is_refused(runner):
    batch = extend_batch(runner)
    assert_refused(runner, dataclasses.replace(batch, batch_size=2), r"expected 2 entries \(batch_size\), got 3 and 3")


def test_the_context_validates_a_callers_batch_too(runner):
    batch = extend_batch(runner)
    loc = batch.out_cache_loc.clone()
    loc[0] = 0
    bad = dataclasses.replace(batch, out_cache_loc=loc, out_cache_loc_cpu=loc.clone())
    with pytest.raises(InvalidInputError, match="out_cache_loc: expected allocated KV slots"):
        with forward_context(bad, runner.backend):
            pass


def test_a_batch_without_host_copies_is_checked_from_its_device_tensors(runner):
    batch = extend_batch(runner)
    loc = batch.out_cache_loc.clone()
    loc[0] = 0
    bad = dataclasses.replace(batch, out_cache_loc=loc, out_cache_loc_cpu=None, req_pool_indices_cpu=None)
    assert_refused(runner, bad, "out_cache_loc: expected allocated KV slots")


def test_the_runner_still_runs_a_correct_step_after_refusing_one(runner):
    batch = extend_batch(runner)
    want = runner.forward_step(batch)
    loc = batch.out_cache_loc.clone()
    loc[0] = runner.kv_pool.num_slots + 1
    assert_refused(
        runner, dataclasses.replace(batch, out_cache_loc=loc, out_cache_loc_cpu=loc.clone()), "out_cache_loc"
    )
    assert torch.equal(runner.forward_step(batch), want)


def test_build_refuses_a_negative_new_token_count_with_the_reason():
    with pytest.raises(InvalidInputError, match=r"extend_lens: expected ints >= 0, got \[-1\]"):
        ForwardBatch.build(ForwardMode.EXTEND, torch.zeros(2, dtype=torch.int64), torch.tensor([0]),
                           [0], [-1], torch.tensor([1, 2]))  # fmt: skip


def test_build_refuses_int32_slots_with_the_dtype():
    with pytest.raises(InvalidInputError, match="out_cache_loc: expected a 1-D int64 tensor, got torch.int32"):
        ForwardBatch.build(ForwardMode.EXTEND, torch.zeros(2, dtype=torch.int64), torch.tensor([0]),
                           [0], [2], torch.tensor([1, 2], dtype=torch.int32))  # fmt: skip


@pytest.mark.gpu
def test_gpu_a_slot_past_the_pool_is_refused_and_the_context_survives(model):
    cuda_model = build_random_model(model.config, dtype=torch.bfloat16, device="cuda", seed=0)
    runner = ModelRunner(cuda_model, max_reqs=4, max_context_len=CONTEXT, backend="torch")
    batch = extend_batch(runner)
    want = runner.forward_step(batch)
    loc = batch.out_cache_loc.clone()
    loc[0] = runner.kv_pool.num_slots + 1000
    # Host copies absent: the check copies the device tensors back first.
    bad = dataclasses.replace(batch, out_cache_loc=loc, out_cache_loc_cpu=None)
    assert_refused(runner, bad, "out_cache_loc: expected allocated KV slots")
    torch.cuda.synchronize()  # a device-side assert would surface here
    assert torch.equal(runner.forward_step(batch), want)


def test_slots_of_a_long_prefill_are_checked_too(model):
    """Past 1024 new tokens the slot checks take the vectorised path."""
    runner = ModelRunner(model, max_reqs=2, max_context_len=1200, backend="torch")
    batch = extend_batch(runner, prefix=(0,), extend=(1100,))
    check_batch(batch, runner.req_to_token_pool, runner.kv_pool)
    loc = batch.out_cache_loc.clone()
    loc[1050] = loc[3]
    bad = dataclasses.replace(batch, out_cache_loc=loc, out_cache_loc_cpu=loc.clone())
    assert_refused(runner, bad, "out_cache_loc: expected a distinct slot per new token")
    loc[1050] = 0
    bad = dataclasses.replace(batch, out_cache_loc=loc, out_cache_loc_cpu=loc.clone())
    assert_refused(runner, bad, "out_cache_loc: expected allocated KV slots")
