"""Non-finite values through every backend.

The contract: a non-finite value reaches an output row if and only if it is in
that row's query or in a key or value the row may see (a non-finite scale is
refused before anything runs: tests/test_bad_input_ops.py). Values of
keys a row may not see because they lie outside its request's key extent (the
dummy slot padded tokens write to, other requests' slots, stale table entries)
never reach it. Keys inside the extent but masked for the row are left out:
flash kernels multiply their weight 0 into a tile, so a NaN there is
implementation-defined.

Faults are planted in layer 0 only; layer 1 is the control and stays finite.
Every row of the random batches sees at least one key.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from test_backends_differential import (
    ATOL_BF16,
    ATOL_F32,
    CASES,
    GPU_HEAD_DIM,
    GRAPH_CASES,
    HKV,
    HQ,
    Pools,
    assert_close,
    capture,
    draw_batch,
    graph_backend,
    init_graph_state,
    make_backend,
    make_pools,
    pad_for_graph,
    pad_qkv,
    random_qkv,
    replay,
)

from sgl_piecewise import ForwardBatch, ForwardMode, forward_context
from sgl_piecewise.backends import ReferenceBackend
from sgl_piecewise.engine.testing import random_batch, release_batch
from sgl_piecewise.memory import DUMMY_SLOT
from sgl_piecewise.ops import unified_attention

# Triton's interpreter computes with numpy, which warns on every NaN and inf
# these tests plant on purpose.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

GROUP = HQ // HKV  # query heads 0 .. GROUP-1 read kv head 0
CPU_BACKENDS = [(name, "cpu") for name in ("reference", "torch", "triton")]
GPU_BACKENDS = [pytest.param(name, "cuda", marks=pytest.mark.gpu) for name in ("torch", "triton", "flashinfer")]
BACKENDS = CPU_BACKENDS + GPU_BACKENDS
GRAPH_BACKENDS = [(name, "cpu") for name in ("torch", "triton")] + GPU_BACKENDS
CASE = {c.id: c for c in CASES}
EAGER_CASES = [c for c in CASES if not c.mode.is_idle()]
REPLAY_CASES = [c for c in GRAPH_CASES if not c.mode.is_idle()]
PLANTS = ["query_nan", "key_inf", "value_nan"]
DUMMY_VALUES = [float("nan"), float("inf")]


def setup(device: str):
    """``(pools, atol)``: float32 on the CPU, bf16 at a head size FlashInfer ships on CUDA."""
    if device == "cuda":
        return make_pools("cuda", torch.bfloat16, GPU_HEAD_DIM), ATOL_BF16
    return make_pools(), ATOL_F32


def attend_scaled(backend, batch: ForwardBatch, qkv, scales, check: bool = False) -> list[torch.Tensor]:
    """``check=False``: graph-path batches are padded as a runner pads its
    static batch, which the context's caller-batch validation would refuse."""
    with forward_context(batch, backend, check=check):
        return [unified_attention(q, k, v, layer_id=i, scale=s) for i, ((q, k, v), s) in enumerate(zip(qkv, scales))]


def eager_scaled(backend, batch: ForwardBatch, qkv, scales) -> list[torch.Tensor]:
    backend.init_forward_metadata(batch)
    return attend_scaled(backend, batch, qkv, scales, check=True)


# ---- planting -----------------------------------------------------------------
@dataclass
class Planted:
    """Where a fault went: the scales to pass, and the ``[T, Hq]`` rows the
    contract says must be NaN (None where only the reference can say)."""

    scales: list[float | None]
    must_nan: torch.Tensor | None
    request_rows: torch.Tensor  # [T] bool: the tokens of the request the fault is in
    row: int  # a query row of that request that sees the planted key


def _longest_request(batch: ForwardBatch) -> int:
    kv = [p + e for p, e in zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu)]
    return max(range(len(kv)), key=kv.__getitem__)


def _plant_in_key0(pools: Pools, batch: ForwardBatch, qkv, r: int, which: int, value: float) -> None:
    """Component 0 of kv head 0 of request ``r``'s first key (every query row
    of ``r`` sees it: causal, or a tree mask over a non-empty prefix), in the
    key (``which`` 1) or value (2), as indexed in ``(q, k, v)``."""
    start = sum(batch.extend_seq_lens_cpu[:r])
    if batch.extend_prefix_lens_cpu[r] == 0:  # the key is a new token's: the op writes it
        qkv[0][which][start, 0, 0] = value
        return
    slot = int(pools.req.req_to_token[int(batch.req_pool_indices[r]), 0])
    buffers = pools.kv.k_buffers if which == 1 else pools.kv.v_buffers
    buffers[0][slot, 0, 0] = value


def plant(kind: str, pools: Pools, batch: ForwardBatch, qkv, rng: random.Random) -> Planted:
    n, r = batch.num_tokens, _longest_request(batch)
    start = sum(batch.extend_seq_lens_cpu[:r])
    request_rows = torch.zeros(n, dtype=torch.bool)
    request_rows[start : start + batch.extend_seq_lens_cpu[r]] = True
    row = start + batch.extend_seq_lens_cpu[r] - 1
    must = torch.zeros(n, HQ, dtype=torch.bool)
    scales: list[float | None] = [None, None]
    if kind == "query_nan":
        t, h = rng.randrange(n), rng.randrange(HQ)
        qkv[0][0][t, h, rng.randrange(qkv[0][0].shape[2])] = float("nan")
        must[t, h] = True
    elif kind == "value_nan":
        _plant_in_key0(pools, batch, qkv, r, 2, float("nan"))
        must[request_rows, :GROUP] = True
    else:  # +inf key: head 0's logit +inf (softmax NaN), head 1's -inf (the key drops out)
        _plant_in_key0(pools, batch, qkv, r, 1, float("inf"))
        qkv[0][0][row, 0, 0], qkv[0][0][row, 1, 0] = 1.0, -1.0
        must = None
    return Planted(scales, must, request_rows, row)


# ---- checks -------------------------------------------------------------------
def nan_rows(out: torch.Tensor) -> torch.Tensor:
    """``[T, Hq]`` bool: the (token, head) rows holding a NaN."""
    return torch.isnan(out).any(dim=-1).cpu()


def assert_same_nans_and_close(got: list[torch.Tensor], want: list[torch.Tensor], atol: float) -> None:
    for layer, (g, w) in enumerate(zip(got, want)):
        nan_g, nan_w = torch.isnan(g).cpu(), torch.isnan(w).cpu()
        diff = (nan_g != nan_w).nonzero()[:4].tolist()
        assert torch.equal(nan_g, nan_w), (
            f"layer {layer}: expected the reference's NaN pattern, got a difference at (token, head, dim) {diff}"
        )
        keep = ~nan_w.to(w.device)
        assert_close([torch.where(keep, g, 0)], [torch.where(keep, w, 0)], atol)


def assert_contract(out: list[torch.Tensor], planted: Planted) -> None:
    rows = nan_rows(out[0])
    if planted.must_nan is not None:
        want = planted.must_nan.nonzero().tolist()
        assert torch.equal(rows, planted.must_nan), f"expected NaN rows {want}, got {rows.nonzero().tolist()}"
    else:
        got = rows[planted.row, :2].tolist()
        assert got == [True, False], f"row {planted.row}: expected NaN in head 0 only, got {got} for heads 0, 1"
        outside = (rows & ~planted.request_rows[:, None]).nonzero().tolist()
        assert not outside, f"expected no NaN outside the faulty request, got (token, head) {outside}"
    assert torch.isfinite(out[1]).all(), "layer 1 (no fault planted): expected finite values, got non-finite"


def assert_finite(outs: list[torch.Tensor]) -> None:
    for layer, o in enumerate(outs):
        bad = (~torch.isfinite(o)).nonzero()[:4].tolist()
        assert not bad, f"layer {layer}: expected finite values, got non-finite at (token, head, dim) {bad}"


# ---- a fault in what a row sees -------------------------------------------------
@pytest.mark.parametrize("kind", PLANTS)
@pytest.mark.parametrize("case", EAGER_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("name,device", BACKENDS)
def test_a_non_finite_input_reaches_exactly_the_rows_that_see_it(name, device, case, kind):
    rng = random.Random(f"nonfinite-{name}-{case.id}-{kind}")
    pools, atol = setup(device)
    backend, ref = make_backend(name, pools), ReferenceBackend(pools.req, pools.kv)
    batch = draw_batch(pools, case, rng.randint(2, 4), rng)
    qkv = random_qkv(batch.num_tokens, pools, torch.Generator().manual_seed(rng.randrange(2**31)))
    planted = plant(kind, pools, batch, qkv, rng)
    got = eager_scaled(backend, batch, qkv, planted.scales)
    want = eager_scaled(ref, batch, qkv, planted.scales)
    assert_contract(got, planted)
    assert_same_nans_and_close(got, want, atol)


@pytest.mark.parametrize("name,device", BACKENDS)
def test_a_row_that_sees_no_key_outputs_zeros(name, device):
    """A tree-mask row that hides every key: softmax over nothing is zeros, as
    SDPA gives, not the mean of the hidden values."""
    rng = random.Random(f"blind-{name}")
    pools, _ = setup(device)
    backend = make_backend(name, pools)
    batch = draw_batch(pools, CASE["verify_tree_mask"], 3, rng)
    kv_len = batch.extend_prefix_lens_cpu[0] + batch.extend_seq_lens_cpu[0]
    batch.spec_info.custom_mask[:kv_len] = False  # request 0, query row 0
    qkv = random_qkv(batch.num_tokens, pools, torch.Generator().manual_seed(rng.randrange(2**31)))
    out = eager_scaled(backend, batch, qkv, [None, None])
    for o in out:
        assert torch.equal(o[0], torch.zeros_like(o[0]))
        assert_finite([o[1:]])
        assert o[1:].abs().amax(dim=-1).gt(0).all(), "expected rows that see keys to be nonzero, got all zeros"


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=lambda m: m.name)
@pytest.mark.parametrize("name,device", BACKENDS)
def test_a_row_whose_visible_logits_are_all_minus_inf_outputs_zeros(name, device, mode):
    """Request 0's first row sees only its own key, whose +inf component meets
    a negative query component: logit -inf, nothing carries weight; zeros, as
    SDPA gives."""
    pools, atol = setup(device)
    backend, ref = make_backend(name, pools), ReferenceBackend(pools.req, pools.kv)
    ext = [3, 5] if mode == ForwardMode.EXTEND else [1, 1]
    batch = random_batch(mode, pools.req, pools.kv, [0, 4], ext, generator=torch.Generator().manual_seed(0))
    qkv = random_qkv(batch.num_tokens, pools, torch.Generator().manual_seed(1))
    qkv[0][1][0, 0, 0] = float("inf")
    qkv[0][0][0, :GROUP, 0] = -1.0
    got = eager_scaled(backend, batch, qkv, [None, None])
    assert torch.equal(got[0][0, :GROUP], torch.zeros_like(got[0][0, :GROUP]))
    assert_same_nans_and_close(got, eager_scaled(ref, batch, qkv, [None, None]), atol)


# ---- a fault in what no row may see --------------------------------------------
def poison_dummy_slot(pools: Pools, value: float) -> None:
    for layer in range(pools.kv.num_layers):
        pools.kv.k_buffers[layer][DUMMY_SLOT] = value
        pools.kv.v_buffers[layer][DUMMY_SLOT] = value


@pytest.mark.parametrize("value", DUMMY_VALUES, ids=str)
@pytest.mark.parametrize("case", EAGER_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("name,device", BACKENDS)
def test_a_non_finite_dummy_slot_never_reaches_a_real_row(name, device, case, value):
    """Ragged requests of different lengths: the shorter ones' page-table rows
    run past their extent into the dummy slot."""
    rng = random.Random(f"dummy-{name}-{case.id}")
    pools, _ = setup(device)
    backend = make_backend(name, pools)
    batch = draw_batch(pools, case, 4, rng)
    kv = [p + e for p, e in zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu)]
    assert len(set(kv)) > 1, f"expected requests of different lengths, got {kv}"
    qkv = random_qkv(batch.num_tokens, pools, torch.Generator().manual_seed(rng.randrange(2**31)))
    clean = eager_scaled(backend, batch, qkv, [None, None])
    poison_dummy_slot(pools, value)
    got = eager_scaled(backend, batch, qkv, [None, None])
    assert_finite(got)
    for g, c in zip(got, clean):
        assert torch.equal(g, c)


@pytest.mark.parametrize("value", DUMMY_VALUES, ids=str)
@pytest.mark.parametrize("case", REPLAY_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("name,device", GRAPH_BACKENDS)
def test_replay_with_non_finite_padding_keeps_real_rows_finite(name, device, case, value):
    """Capture, then replay a fresh batch padded with requests that read the
    dummy slot; the padded tokens' own K/V (written there) are non-finite too."""
    rng = random.Random(f"dummy-graph-{name}-{case.id}")
    pools, atol = setup(device)
    backend, ref = graph_backend(name, case.mode, pools), ReferenceBackend(pools.req, pools.kv)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    padded_bs, fill = 4, backend.get_cuda_graph_seq_len_fill_value()
    init_graph_state(backend, case.mode)
    first = draw_batch(pools, case, 2, rng)
    capture(backend, pad_for_graph(first, padded_bs, fill))
    release_batch(pools.req, pools.kv, first)  # request row 0, which padding reads, is all dummy again

    batch = draw_batch(pools, case, rng.randint(1, padded_bs - 1), rng)
    qkv = random_qkv(batch.num_tokens, pools, gen)
    padded = pad_for_graph(batch, padded_bs, fill)
    padded_qkv = pad_qkv(qkv, batch, padded, pools, gen)
    for _, k, v in padded_qkv:
        k[batch.num_tokens :] = value
        v[batch.num_tokens :] = value
    poison_dummy_slot(pools, value)
    replay(backend, padded)
    got = [o[: batch.num_tokens] for o in attend_scaled(backend, padded, padded_qkv, [None, None])]
    assert_finite(got)
    assert_close(got, eager_scaled(ref, batch, qkv, [None, None]), atol)
