"""``init_forward_metadata`` refuses a batch it cannot describe, with the
message ``forward_context`` gives for it, before any metadata is touched.

The README's model-author path calls it first, so without the check an
inconsistent batch met an ``IndexError`` deep in a fill (torch), or no error
at all and metadata over another request's row (reference, triton). The
graph hooks stay unchecked: a replay pays nothing.
"""

import dataclasses

import pytest
import torch

from sgl_piecewise import ForwardMode, InvalidInputError, KVPool, ReqToTokenPool, forward_context
from sgl_piecewise.backends import CompositeBackend, ReferenceBackend, base, create_backend
from sgl_piecewise.engine.testing import random_batch, release_batch
from sgl_piecewise.memory import DUMMY_SLOT

HQ, HKV, D, CONTEXT = 4, 2, 8, 32
BACKENDS = ["reference", "torch", "triton"]


def make_backend(name: str):
    if name == "triton":
        pytest.importorskip("triton")
    table = ReqToTokenPool(max_reqs=8, max_context_len=CONTEXT)
    pool = KVPool(num_slots=512, num_layers=1, num_kv_heads=HKV, head_dim=D)
    return create_backend(name, table, pool, num_q_heads=HQ)


def fresh_batch(backend, mode=ForwardMode.EXTEND):
    extend = [3, 4, 1] if mode == ForwardMode.EXTEND else [1, 1, 1]
    return random_batch(mode, backend.req_to_token_pool, backend.kv_pool, [5, 0, 9], extend)


def metadata_of(backend):
    return backend.metadata if isinstance(backend, ReferenceBackend) else backend.forward_metadata


def prefix_past_the_context(batch):
    grow = torch.tensor([CONTEXT, 0, 0], dtype=torch.int32)
    return dataclasses.replace(
        batch,
        extend_prefix_lens_cpu=[batch.extend_prefix_lens_cpu[0] + CONTEXT] + batch.extend_prefix_lens_cpu[1:],
        extend_prefix_lens=batch.extend_prefix_lens + grow,
        seq_lens=batch.seq_lens + grow,
        seq_lens_cpu=batch.seq_lens_cpu + grow,
    )


def row_out_of_range(batch):
    rows = batch.req_pool_indices.clone()
    rows[0] = 99
    return dataclasses.replace(batch, req_pool_indices=rows, req_pool_indices_cpu=rows.clone())


def row_out_of_range_on_the_device_only(batch):
    """The host copy stays right: only the tensor the fills gather with is
    wrong (checked where it is on the CPU, at no cost)."""
    rows = batch.req_pool_indices.clone()
    rows[0] = 99
    return dataclasses.replace(batch, req_pool_indices=rows)


def batch_size_above_the_tensors(batch):
    return dataclasses.replace(batch, batch_size=batch.batch_size + 1)


def lengths_longer_than_batch_size(batch):
    return dataclasses.replace(batch, seq_lens=torch.cat([batch.seq_lens, batch.seq_lens[:1]]))


FAULTS = {
    prefix_past_the_context: r"request 0: expected prefix \+ new tokens <= max_context_len \(32\)",
    row_out_of_range: r"req_pool_indices: expected rows allocated in the request table \[0, 8\), got \[99\]",
    row_out_of_range_on_the_device_only: r"req_pool_indices: expected rows allocated .*got \[99\]",
    batch_size_above_the_tensors: r"extend_prefix_lens_cpu, extend_seq_lens_cpu: expected 4 entries \(batch_size\)",
    lengths_longer_than_batch_size: r"seq_lens: expected a 1-D tensor of shape \[3\], got \[4\]",
}


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=lambda m: m.name)
@pytest.mark.parametrize("fault", list(FAULTS), ids=lambda f: f.__name__)
def test_an_inconsistent_batch_is_refused_before_the_metadata_is_touched(name, mode, fault):
    backend = make_backend(name)
    good = fresh_batch(backend, mode)
    backend.init_forward_metadata(good)
    before = metadata_of(backend)
    bad = fault(good)
    with pytest.raises(InvalidInputError, match=FAULTS[fault]):
        backend.init_forward_metadata(bad)
    assert metadata_of(backend) is before
    release_batch(backend.req_to_token_pool, backend.kv_pool, good)


@pytest.mark.parametrize("fault", [f for f in FAULTS if f is not row_out_of_range_on_the_device_only],
                         ids=lambda f: f.__name__)  # fmt: skip
def test_the_refusal_reads_as_the_forward_context_s(fault):
    """The same check, not a second one (the device-only row is refused by
    the context's device checks, in their words)."""
    backend = make_backend("torch")
    bad = fault(fresh_batch(backend))
    with pytest.raises(InvalidInputError) as from_metadata:
        backend.init_forward_metadata(bad)
    with pytest.raises(InvalidInputError) as from_context, forward_context(bad, backend):
        pass
    assert str(from_metadata.value) == str(from_context.value)


def test_the_piecewise_capture_s_dummy_slot_batch_still_gets_metadata():
    """Slots are the attention op's to check (forward_context does): the
    piecewise runner's capture writes every token to the dummy slot."""
    backend = make_backend("torch")
    table = backend.req_to_token_pool
    rows = table.alloc(2)
    n = 2 * CONTEXT
    batch = random_batch(ForwardMode.EXTEND, table, backend.kv_pool, [0], [1])  # any live batch beside it
    dummy = type(batch).build(
        ForwardMode.EXTEND,
        torch.zeros(n, dtype=torch.int64),
        torch.tensor(rows, dtype=torch.int64),
        [0, 0],
        [CONTEXT, CONTEXT],
        torch.full((n,), DUMMY_SLOT, dtype=torch.int64),
    )
    backend.init_forward_metadata(dummy)
    assert backend.forward_metadata.num_tokens == n
    with pytest.raises(InvalidInputError, match="out_cache_loc: expected allocated KV slots"):
        with forward_context(dummy, backend):
            pass


def count_checks(monkeypatch) -> list:
    seen = []
    real = base.check_metadata_batch

    def counting(batch, req_pool, kv_pool):
        seen.append(batch)
        real(batch, req_pool, kv_pool)

    monkeypatch.setattr(base, "check_metadata_batch", counting)
    return seen


def test_a_composite_and_a_subclass_check_the_batch_once(monkeypatch):
    """A backend implements ``prepare_metadata``; ``init_forward_metadata``
    checks the batch once before it, a composite's members included."""
    seen = count_checks(monkeypatch)

    class Logged(ReferenceBackend):
        name = "logged"

        def prepare_metadata(self, batch):
            self.last = batch
            super().prepare_metadata(batch)

    backend = make_backend("torch")
    table, pool = backend.req_to_token_pool, backend.kv_pool
    composite = CompositeBackend(Logged(table, pool), [ReferenceBackend(table, pool)], layer_routes={})
    batch = fresh_batch(backend)
    composite.init_forward_metadata(batch)
    assert seen == [batch] and composite.primary.last is batch
    with pytest.raises(InvalidInputError, match="req_pool_indices: expected rows allocated"):
        Logged(table, pool).init_forward_metadata(row_out_of_range(batch))


def test_check_false_skips_the_check_for_a_caller_that_validated_the_batch(monkeypatch):
    seen = count_checks(monkeypatch)
    backend = make_backend("torch")
    batch = fresh_batch(backend)
    backend.init_forward_metadata(batch, check=False)
    assert seen == [] and backend.forward_metadata.num_tokens == batch.num_tokens


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_the_graph_hooks_do_not_check(monkeypatch, name):
    seen = count_checks(monkeypatch)
    backend = make_backend(name)
    batch = fresh_batch(backend, ForwardMode.DECODE)
    backend.init_cuda_graph_state(4, 4)
    args = (batch.req_pool_indices, batch.seq_lens)
    backend.init_forward_metadata_capture_cuda_graph(3, 3, *args, None, ForwardMode.DECODE, None)
    backend.init_forward_metadata_replay_cuda_graph(3, *args, batch.seq_lens_sum, None, ForwardMode.DECODE, None)
    assert seen == []
