"""The paged KV pool and the request table: allocation, exhaustion, the dummy slot."""

import pytest
import torch

from sgl_piecewise import KVPool, KVPoolExhaustedError, ReqToTokenPool
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.memory import DUMMY_SLOT, allocate_requests


def test_alloc_never_hands_out_the_dummy_slot():
    pool = KVPool(num_slots=16, num_layers=1, num_kv_heads=1, head_dim=4)
    slots = pool.alloc(16)
    assert DUMMY_SLOT not in slots.tolist()
    assert sorted(slots.tolist()) == list(range(1, 17))


def test_exhaustion_raises_and_keeps_every_allocated_slot():
    pool = KVPool(num_slots=10, num_layers=2, num_kv_heads=1, head_dim=4)
    held = pool.alloc(7)
    pool.k_buffers[0][held] = torch.randn(7, 1, 4)
    before = pool.k_buffers[0].clone()
    with pytest.raises(KVPoolExhaustedError, match="expected 4 free slots, got 3"):
        pool.alloc(4)
    assert pool.available == 3
    assert torch.equal(pool.k_buffers[0], before)
    # The three that remain are still allocatable, and distinct from the held ones.
    rest = pool.alloc(3)
    assert set(rest.tolist()).isdisjoint(held.tolist())


def test_freed_slots_are_reused():
    pool = KVPool(num_slots=4, num_layers=1, num_kv_heads=1, head_dim=4)
    a = pool.alloc(4)
    pool.free(a[:2])
    assert sorted(pool.alloc(2).tolist()) == sorted(a[:2].tolist())


def test_all_allocated_answers_alike_for_a_tensor_and_a_list_through_alloc_and_free():
    """The list form reads a numpy view of the allocation table: it must see
    every alloc and free the tensor form sees."""
    pool = KVPool(num_slots=8, num_layers=1, num_kv_heads=1, head_dim=4)
    held = pool.alloc(5)

    def both(ids):
        answers = {pool.all_allocated(torch.tensor(ids, dtype=torch.int64)), pool.all_allocated(ids)}
        assert len(answers) == 1, ids
        return answers.pop()

    assert both(held.tolist()) and both(held[:1].tolist())
    assert not both([6]) and not both(held.tolist() + [7])  # never handed out
    pool.free(held[1:3])
    assert not both(held[1:2].tolist()) and both(held[3:].tolist())
    assert both(sorted(set(pool.alloc(2).tolist()) | {held[0].item()}))  # the freed slots, handed out again


def test_free_rejects_the_dummy_slot_and_out_of_range_slots():
    pool = KVPool(num_slots=4, num_layers=1, num_kv_heads=1, head_dim=4)
    with pytest.raises(InvalidInputError, match=r"expected slots in \[1, 4\]"):
        pool.free(torch.tensor([DUMMY_SLOT]))
    with pytest.raises(InvalidInputError):
        pool.free(torch.tensor([5]))


def test_request_table_exhaustion_keeps_state():
    table = ReqToTokenPool(max_reqs=2, max_context_len=8)
    rows = table.alloc(2)
    with pytest.raises(KVPoolExhaustedError, match="expected room for 1 more requests, got 0 free"):
        table.alloc(1)
    table.free(rows[:1])
    assert table.alloc(1) == rows[:1]


def test_request_table_rejects_writes_past_the_context():
    table = ReqToTokenPool(max_reqs=1, max_context_len=8)
    (row,) = table.alloc(1)
    with pytest.raises(InvalidInputError, match="expected at most 8 tokens of context, got 9"):
        table.write(row, 4, torch.arange(5))


def test_request_table_rejects_double_free():
    table = ReqToTokenPool(max_reqs=2, max_context_len=8)
    rows = table.alloc(1)
    table.free(rows)
    with pytest.raises(InvalidInputError, match="expected allocated request rows"):
        table.free(rows)


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_pool_sizes_must_be_positive_ints(bad):
    with pytest.raises(InvalidInputError, match="expected a positive int"):
        KVPool(num_slots=bad, num_layers=1, num_kv_heads=1, head_dim=4)


def test_allocate_requests_is_all_or_nothing():
    table = ReqToTokenPool(max_reqs=4, max_context_len=32)
    pool = KVPool(num_slots=20, num_layers=1, num_kv_heads=1, head_dim=4)
    with pytest.raises(KVPoolExhaustedError, match="expected 21 free slots, got 20"):
        allocate_requests(table, pool, [5, 0], [6, 10])
    assert pool.available == 20 and table.available == 4
    rows, loc = allocate_requests(table, pool, [5, 0], [6, 9])
    assert loc.tolist() == table.req_to_token[rows[0], 5:11].tolist() + table.req_to_token[rows[1], :9].tolist()
    assert pool.available == 0


def test_write_next_records_one_slot_per_row_and_rejects_positions_past_the_context():
    table = ReqToTokenPool(max_reqs=3, max_context_len=8)
    rows = torch.tensor(table.alloc(3))
    table.write_next(rows, [0, 5, 7], torch.tensor([11, 12, 13]))
    assert [table.req_to_token[r, p].item() for r, p in zip(rows.tolist(), [0, 5, 7])] == [11, 12, 13]
    with pytest.raises(InvalidInputError, match="expected at most 8 tokens of context, got 9"):
        table.write_next(rows[:1], [8], torch.tensor([14]))


def test_free_refuses_a_double_free_and_keeps_the_pool_as_it_was():
    pool = KVPool(num_slots=8, num_layers=1, num_kv_heads=1, head_dim=4)
    slots = pool.alloc(3)
    pool.free(slots[:1])
    with pytest.raises(InvalidInputError, match="expected allocated slots, got \\[1\\] not allocated"):
        pool.free(slots[:1])
    # Without the check the freed slot went back twice and the next alloc
    # handed it to two requests.
    assert pool.available == 6
    again = pool.alloc(6)
    assert len(set(again.tolist())) == 6


def test_free_refuses_a_slot_that_was_never_allocated():
    pool = KVPool(num_slots=8, num_layers=1, num_kv_heads=1, head_dim=4)
    pool.alloc(2)
    with pytest.raises(InvalidInputError, match="not allocated"):
        pool.free(torch.tensor([7]))
    assert pool.available == 6  # not 7: nothing was added


def test_free_refuses_a_slot_named_twice_in_one_call():
    pool = KVPool(num_slots=8, num_layers=1, num_kv_heads=1, head_dim=4)
    slots = pool.alloc(2)
    with pytest.raises(InvalidInputError, match="distinct"):
        pool.free(torch.tensor([slots[0], slots[0]]))
    assert pool.available == 6


def test_allocate_requests_refuses_a_request_longer_than_the_context_before_taking_anything():
    table = ReqToTokenPool(max_reqs=4, max_context_len=32)
    pool = KVPool(num_slots=200, num_layers=1, num_kv_heads=1, head_dim=4)
    with pytest.raises(InvalidInputError, match="request 1 too long: expected prefix \\+ new <= 32"):
        allocate_requests(table, pool, [10, 30], [6, 10])
    assert pool.available == 200 and table.available == 4


@pytest.mark.parametrize(
    "prefix, extend, match",
    [
        ([0], [-1], "extend_lens: expected ints >= 0"),
        ([-2], [3], "prefix_lens: expected ints >= 0"),
        ([0, 1], [3], "one entry per request"),
        ([0], [2.0], "extend_lens: expected ints >= 0"),
    ],
)
def test_allocate_requests_refuses_bad_lengths_and_takes_nothing(prefix, extend, match):
    table = ReqToTokenPool(max_reqs=4, max_context_len=32)
    pool = KVPool(num_slots=64, num_layers=1, num_kv_heads=1, head_dim=4)
    with pytest.raises(InvalidInputError, match=match):
        allocate_requests(table, pool, prefix, extend)
    assert pool.available == 64 and table.available == 4


def test_request_table_free_of_a_row_twice_in_one_call_changes_nothing():
    table = ReqToTokenPool(max_reqs=2, max_context_len=8)
    (row,) = table.alloc(1)
    with pytest.raises(InvalidInputError, match="distinct"):
        table.free([row, row])
    assert table.available == 1 and table.is_allocated(row)


# ---- speculative windows: write_block, unmap, mapped_slots -------------------
def test_a_window_is_recorded_at_each_requests_own_positions():
    table = ReqToTokenPool(max_reqs=4, max_context_len=16)
    rows = torch.tensor(table.alloc(2))
    slots = torch.randperm(50)[:6].add(1).view(2, 3)
    table.write_block(rows, [4, 9], slots)
    assert table.req_to_token[rows[0], 4:7].tolist() == slots[0].tolist()
    assert table.req_to_token[rows[1], 9:12].tolist() == slots[1].tolist()
    # Nothing else of either row moved off the dummy slot.
    assert int((table.req_to_token != DUMMY_SLOT).sum()) == 6


def test_a_window_past_the_context_is_refused_and_writes_nothing():
    table = ReqToTokenPool(max_reqs=2, max_context_len=8)
    rows = torch.tensor(table.alloc(2))
    with pytest.raises(InvalidInputError, match="expected at most 8 tokens of context, got 9"):
        table.write_block(rows, [0, 6], torch.arange(1, 7).view(2, 3))
    assert int((table.req_to_token != DUMMY_SLOT).sum()) == 0


def test_unmap_returns_the_slots_and_points_the_entries_at_the_dummy():
    table = ReqToTokenPool(max_reqs=2, max_context_len=8)
    rows = torch.tensor(table.alloc(2))
    slots = torch.arange(1, 9).view(2, 4)
    table.write_block(rows, [0, 2], slots)
    got = table.unmap([int(rows[0]), int(rows[1]), int(rows[1])], [3, 4, 5])
    assert got.tolist() == [4, 7, 8] and got.dtype == torch.int64
    assert table.mapped_slots(rows.tolist()).tolist() == [1, 2, 3, 5, 6]


def test_unmap_of_an_empty_entry_is_refused_and_changes_nothing():
    table = ReqToTokenPool(max_reqs=1, max_context_len=8)
    (row,) = table.alloc(1)
    table.write(row, 0, torch.tensor([3, 4]))
    before = table.req_to_token.clone()
    with pytest.raises(InvalidInputError, match=r"expected \(row, position\) pairs that map a slot, got \[\(0, 2\)\]"):
        table.unmap([row, row], [1, 2])
    assert torch.equal(table.req_to_token, before)
