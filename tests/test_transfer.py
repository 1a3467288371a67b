"""``transfer.to_device``: a step's small host tensors in one copy that does not wait."""

import pytest
import torch

from sgl_piecewise.forward import ForwardBatch, ForwardMode
from sgl_piecewise.transfer import ALIGN, pack, to_device, unpack


def _odd_tensors():
    """Odd sizes and every dtype a step sends: int64, int32, a 0-d count, an empty one, a strided view, bools."""
    return [
        torch.arange(5),
        torch.tensor([3, -1, 7], dtype=torch.int32),
        torch.tensor(17, dtype=torch.int32),
        torch.empty(0, dtype=torch.int64),
        torch.arange(12).view(3, 4)[:, 1],
        torch.tensor([True, False, True]),
    ]


def test_pack_then_unpack_gives_each_tensor_back_at_an_aligned_offset():
    tensors = _odd_tensors()
    staging, offsets = pack(tensors)
    assert staging.dtype == torch.uint8 and all(o % ALIGN == 0 for o in offsets)
    back = unpack(staging.clone(), tensors, offsets)
    for want, got in zip(tensors, back):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_pack_copies_so_a_later_change_of_a_source_is_not_sent():
    source = torch.arange(4)
    staging, offsets = pack([source])
    source.fill_(9)
    assert unpack(staging, [source], offsets)[0].tolist() == [0, 1, 2, 3]


def test_to_device_on_the_cpu_moves_nothing():
    tensors = _odd_tensors()
    assert all(a is b for a, b in zip(to_device(tensors, "cpu"), tensors))


@pytest.mark.gpu
def test_to_device_on_cuda_sends_the_host_tensors_without_a_synchronisation():
    device = torch.device("cuda")
    on_device = torch.arange(3, device=device)
    tensors = [*_odd_tensors(), on_device]
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = to_device(tensors, device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert moved[-1] is on_device
    for want, got in zip(tensors, moved):
        assert got.device.type == "cuda" and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.gpu
def test_a_cuda_batch_is_built_without_a_synchronisation():
    device = torch.device("cuda")
    ids = torch.arange(5, device=device)
    rows, loc = torch.tensor([0, 1]), torch.tensor([4, 5, 6, 7, 8])
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, [0, 3], [2, 3], loc)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert batch.positions.tolist() == [0, 1, 3, 4, 5]
    assert batch.seq_lens.tolist() == [2, 6] and batch.seq_lens.dtype == torch.int32
    assert batch.req_pool_indices.tolist() == [0, 1] and batch.out_cache_loc.tolist() == loc.tolist()
    assert int(batch.num_token_non_padded) == 5
