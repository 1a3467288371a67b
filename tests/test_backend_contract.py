"""The capture/replay contract every graph-capable backend keeps (docs/ARCHITECTURE.md,
"Attention backend contract"), the registry, and the composite backend."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys

import pytest
import torch
from test_backends_differential import (
    CASES,
    FLASHINFER_ON_GPU,
    GRAPH_CASES,
    HQ,
    MAX_BS,
    VERIFY_WIDTH,
    assert_close,
    attend,
    capture,
    draw_batch,
    eager,
    graph_backend,
    init_graph_state,
    make_backend,
    make_pools,
    pad_for_graph,
    pools_for,
    random_qkv,
    replay,
)
from torch.utils._python_dispatch import TorchDispatchMode

from sgl_piecewise import ForwardMode, InvalidInputError, SpecInfo, UnsupportedModeError
from sgl_piecewise.backends import (
    BackendUnavailableError,
    CompositeBackend,
    ReferenceBackend,
    TorchGraphBackend,
    backend_names,
    create_backend,
    get_backend_class,
)
from sgl_piecewise.backends.base import ALL_MODES
from sgl_piecewise.graphs.fill_graphs import record_fills

GRAPH_BACKENDS = ["torch", "triton"]
# FlashInfer runs only on CUDA (bf16, a head size it ships). Its replay hook
# calls plan(), which reads the indptrs on the host by design, so it is not
# in the no-host-sync test.
WITH_FLASHINFER = GRAPH_BACKENDS + [FLASHINFER_ON_GPU]
CASE = {c.id: c for c in CASES}


def _graph_ready(name, case):
    pools = pools_for(name)
    return graph_backend(name, case.mode, pools), pools


# ---- registry -------------------------------------------------------------
def test_registry_names_every_backend_and_builds_it_by_name():
    assert backend_names() == ("reference", "torch", "triton", "flashinfer")
    pools = make_pools()
    for name in ("reference", "torch", "triton"):
        if name == "triton" and not triton_runs_on_cpu_tensors():
            # CPU pools, and the kernels were not loaded under the interpreter.
            with pytest.raises(BackendUnavailableError, match="expected TRITON_INTERPRET=1"):
                make_backend(name, pools)
            continue
        backend = make_backend(name, pools)
        assert type(backend) is get_backend_class(name) and backend.name == name


def triton_runs_on_cpu_tensors() -> bool:
    from sgl_piecewise.backends.triton_kernels.decode import INTERPRETED

    return INTERPRETED


def test_registry_rejects_an_unknown_name_listing_the_known_ones():
    with pytest.raises(InvalidInputError, match=r"expected one of \['reference', 'torch'.*got 'cudnn'"):
        get_backend_class("cudnn")


def test_importing_the_backends_loads_neither_triton_kernels_nor_flashinfer():
    # torch itself may import triton; what must stay optional is our kernel
    # modules (they need triton to import) and flashinfer.
    code = (
        "import sys, sgl_piecewise.backends, sgl_piecewise.backends.flashinfer_backend; "
        "bad = [m for m in ('flashinfer', 'sgl_piecewise.backends.triton_backend', "
        "'sgl_piecewise.backends.triton_kernels') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_flashinfer_without_its_package_names_the_gpu_extra():
    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("flashinfer is installed")
    pools = make_pools()
    with pytest.raises(BackendUnavailableError, match=r"pip install sgl_piecewise\[gpu\]") as info:
        create_backend("flashinfer", pools.req, pools.kv, num_q_heads=HQ)
    assert isinstance(info.value, ImportError)


@pytest.mark.gpu
def test_flashinfer_refuses_head_sizes_its_kernels_do_not_serve():
    pytest.importorskip("flashinfer")
    pools = make_pools("cuda", torch.bfloat16, head_dim=32)
    with pytest.raises(InvalidInputError, match=r"head_dim in \(64, 128, 256\), got 32"):
        create_backend("flashinfer", pools.req, pools.kv, num_q_heads=HQ)
    cpu = make_pools(head_dim=64)
    with pytest.raises(InvalidInputError, match="CUDA device"):
        create_backend("flashinfer", cpu.req, cpu.kv, num_q_heads=HQ)


@pytest.mark.triton_cpu  # a triton backend over CPU pools
def test_triton_backend_requires_query_heads_that_group_the_kv_heads():
    pytest.importorskip("triton")
    pools = make_pools()
    for bad in (None, 0, 3):  # 3 is not a multiple of the pool's 2 kv heads
        with pytest.raises(InvalidInputError, match="num_q_heads"):
            create_backend("triton", pools.req, pools.kv, num_q_heads=bad)


# ---- capabilities ---------------------------------------------------------
@pytest.mark.parametrize("name", WITH_FLASHINFER)
def test_graph_backends_serve_every_mode_and_pad_with_seq_len_one(name):
    backend = make_backend(name, pools_for(name))
    assert backend.supports_cuda_graph and backend.supported_modes == ALL_MODES
    assert backend.get_cuda_graph_seq_len_fill_value() == 1


def test_reference_backend_refuses_graph_hooks():
    pools = make_pools()
    ref = ReferenceBackend(pools.req, pools.kv)
    with pytest.raises(UnsupportedModeError, match="supports_cuda_graph=True"):
        ref.init_cuda_graph_state(MAX_BS, MAX_BS)


# ---- Pattern A --------------------------------------------------------------
def _storage_ranges(buffers):
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in buffers.values()]


@pytest.mark.parametrize("case", GRAPH_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("name", WITH_FLASHINFER)
def test_capture_binds_static_views_and_replay_refills_them_in_place(name, case):
    rng = random.Random(f"views-{name}-{case.id}")
    backend, pools = _graph_ready(name, case)
    buffers = backend.cuda_graph_buffers()
    addresses = {k: t.data_ptr() for k, t in buffers.items()}
    fill = backend.get_cuda_graph_seq_len_fill_value()
    bs = 0 if case.mode.is_idle() else 3
    captured = pad_for_graph(draw_batch(pools, case, bs, rng), 4, fill)
    capture(backend, captured)
    meta = backend.forward_metadata
    inside = _storage_ranges(buffers)
    for field, value in vars(meta).items():
        if isinstance(value, torch.Tensor):
            assert any(lo <= value.data_ptr() < hi for lo, hi in inside), f"{field} is not a static view"
    # Capture already filled the runtime values (it delegated to replay).
    expected_kv = captured.seq_lens + (captured.extend_seq_lens if case.mode.seq_lens_exclude_new_tokens() else 0)
    assert torch.equal(meta.kv_lens, expected_kv.to(torch.int32))

    for _ in range(2):
        replay(backend, pad_for_graph(draw_batch(pools, case, bs, rng), 4, fill))
        assert backend.forward_metadata is meta
    assert {k: t.data_ptr() for k, t in backend.cuda_graph_buffers().items()} == addresses


@pytest.mark.parametrize("case", [c for c in GRAPH_CASES if not c.mode.is_idle()], ids=lambda c: c.id)
@pytest.mark.parametrize("name", WITH_FLASHINFER)
def test_eager_and_replay_compute_the_same_metadata_for_one_batch(name, case):
    """Same fill helpers on both paths: an unpadded uniform batch gives equal
    lengths, indptrs and key slots eagerly and through replay."""
    rng = random.Random(f"same-{name}-{case.id}")
    pools = pools_for(name)
    batch = draw_batch(pools, case, 4, rng)
    eager_backend = make_backend(name, pools)
    eager_backend.init_forward_metadata(batch)
    e = eager_backend.forward_metadata
    graph = graph_backend(name, case.mode, pools)
    capture(graph, batch)
    g = graph.forward_metadata
    for field in ("q_lens", "kv_lens", "qo_indptr", "kv_indptr"):
        assert torch.equal(getattr(e, field), getattr(g, field)), field
    assert (e.max_q_len, e.num_tokens, e.masked) == (g.max_q_len, g.num_tokens, g.masked)
    if name in ("triton", "flashinfer"):
        total = int(e.kv_indptr[-1])
        assert torch.equal(e.kv_indices, g.kv_indices[:total])
    else:
        width = e.page_table.shape[1]
        assert torch.equal(e.page_table, g.page_table[:, :width])
        assert torch.equal(e.hidden, g.hidden[:, :, :width])
        assert g.hidden[:, :, width:].all()
        assert torch.equal(e.past_extent, g.past_extent[:, :width])
        assert g.past_extent[:, width:].all()


class NoHostSync(TorchDispatchMode):
    """Fails on ops that move values between host and device, each a sync on
    CUDA: reads back (``.item()``, ``int(t)``, ``bool(t)``, ``nonzero``,
    boolean-mask indexing) and fresh host data written in (``x[0] = 0``,
    ``torch.tensor(...)``: ``lift_fresh``). ``tolist`` does not dispatch; the
    GPU test's sync debug mode covers it."""

    FORBIDDEN = {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.nonzero.default,
        torch.ops.aten.masked_select.default,
        torch.ops.aten.lift_fresh.default,
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        bool_index = func is torch.ops.aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        )
        if func in self.FORBIDDEN or bool_index:
            raise AssertionError(f"host sync on the replay path: {func}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", GRAPH_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("name", GRAPH_BACKENDS)
def test_replay_hook_moves_no_value_between_host_and_device(name, case):
    rng = random.Random(f"nosync-{name}-{case.id}")
    backend, pools = _graph_ready(name, case)
    fill = backend.get_cuda_graph_seq_len_fill_value()
    bs = 0 if case.mode.is_idle() else 3
    capture(backend, pad_for_graph(draw_batch(pools, case, bs, rng), 4, fill))
    batch = pad_for_graph(draw_batch(pools, case, bs, rng), 4, fill)
    qkv = random_qkv(batch.num_tokens, pools, torch.Generator().manual_seed(1))
    seq_lens_sum = batch.seq_lens_sum
    with NoHostSync():
        backend.init_forward_metadata_replay_cuda_graph(
            4, batch.req_pool_indices, batch.seq_lens, seq_lens_sum, None, case.mode, batch.spec_info, None
        )
        if name == "torch":  # Triton's interpreter itself copies to numpy: only torch's forward is checked
            attend(backend, batch, qkv)


# ---- the bound fill: eager decode through a binding, replayed fills ----------
DECODE_CASE = CASE["decode"]
TRITON_DEVICES = [pytest.param("cpu", marks=pytest.mark.triton_cpu), pytest.param("cuda", marks=pytest.mark.gpu)]


def _pools_on(device):
    return make_pools() if device == "cpu" else make_pools("cuda", torch.bfloat16, 128)


# Off CUDA the triton decode grid's split axis is max_kv_splits whole (no SM
# count sizes it), one interpreted program per split and (request, kv head).
# A context here holds at most CONTEXT = 80 keys and a split 64 (the
# kernel's tokens_per_split), so no request takes more than 2 splits: 2 keeps
# every request's split count (the merge of 2 splits, and the idle second
# split of a 1-split request) at a 32nd of the default 64's programs.
CPU_TRITON_OPTIONS = dict(max_kv_splits=2)


def _triton_on(device, pools):
    pytest.importorskip("triton")
    options = CPU_TRITON_OPTIONS if device == "cpu" else {}
    return create_backend("triton", pools.req, pools.kv, num_q_heads=HQ, **options)


def _in_static_buffers(backend, t):
    return any(lo <= t.data_ptr() < hi for lo, hi in _storage_ranges(backend.cuda_graph_buffers()))


@pytest.mark.parametrize("case_id", ["decode", "extend_prefix", "mixed"])
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_eager_steps_fill_a_binding_and_attend_exactly_like_fresh_metadata(device, case_id):
    """A triton backend with graph state fills eager DECODE, EXTEND and MIXED
    steps of up to ``max_bs`` requests into its static buffers (through a
    recorded fill on CUDA); the outputs equal, bit for bit, those of a
    backend that fills fresh tensors, over ragged batches whose sizes come
    back. Sizes above ``max_bs`` still get fresh tensors."""
    rng = random.Random(f"eager-bound-{device}-{case_id}")
    pools, case = _pools_on(device), CASE[case_id]
    bound, fresh = _triton_on(device, pools), _triton_on(device, pools)
    init_graph_state(bound, ForwardMode.DECODE)
    capture(bound, pad_for_graph(draw_batch(pools, DECODE_CASE, 3, rng), 4, 1))  # a graph binding of bs 4
    for bs in (1, 4, 4, MAX_BS, 2, MAX_BS + 2):
        batch = draw_batch(pools, case, bs, rng)
        qkv = random_qkv(batch.num_tokens, pools, torch.Generator().manual_seed(rng.randrange(2**31)))
        got = eager(bound, batch, qkv)
        assert _in_static_buffers(bound, bound.forward_metadata.kv_indptr) == (bs <= MAX_BS), bs
        want = eager(fresh, batch, qkv)
        assert not _in_static_buffers(fresh, fresh.forward_metadata.kv_indptr)
        for layer, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"bs {bs}, layer {layer}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", GRAPH_BACKENDS)
def test_gpu_replay_fill_is_recorded_once_and_writes_what_the_plain_fill_writes(name):
    """The replay hook records each binding's fill once and replays it; every
    replayed fill of a fresh batch writes the lengths and key slots an eager
    fill computes, and a tree-masked binding keeps the plain fill."""
    rng = random.Random(f"fill-graph-{name}")
    pools = make_pools("cuda", torch.bfloat16, 128)
    backend, fresh = graph_backend(name, ForwardMode.DECODE, pools), make_backend(name, pools)
    record_fills(backend)  # as every graph runner does
    capture(backend, pad_for_graph(draw_batch(pools, DECODE_CASE, 4, rng), 4, 1))
    recorded = dict(backend._fill_graphs)
    assert len(recorded) == 1 and next(iter(recorded.values())).graph is not None
    for _ in range(3):
        batch = draw_batch(pools, DECODE_CASE, 4, rng)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            replay(backend, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        g = backend.forward_metadata
        fresh.init_forward_metadata(batch)
        e = fresh.forward_metadata
        for field in ("q_lens", "kv_lens", "qo_indptr", "kv_indptr"):
            assert torch.equal(getattr(e, field), getattr(g, field)), field
        if name == "triton":
            total = int(e.kv_indptr[-1])
            assert torch.equal(e.kv_indices, g.kv_indices[:total])
            assert torch.equal(e.num_kv_splits, g.num_kv_splits)
        else:
            width = e.page_table.shape[1]
            assert torch.equal(e.page_table, g.page_table[:, :width])
            assert torch.equal(e.hidden, g.hidden[:, :, :width])
            assert torch.equal(e.past_extent, g.past_extent[:, :width])
    assert backend._fill_graphs == recorded  # replayed, never recorded again

    masked = graph_backend(name, ForwardMode.TARGET_VERIFY, pools)
    record_fills(masked)
    capture(masked, pad_for_graph(draw_batch(pools, CASE["verify_tree_mask"], 4, rng), 4, 1))
    assert not masked._fill_graphs  # the flat mask's length changes per step: plain fill


# ---- misuse -----------------------------------------------------------------
def test_graph_hooks_reject_misuse_with_actionable_errors():
    rng = random.Random("misuse")
    pools = make_pools()
    backend = make_backend("torch", pools)
    batch = draw_batch(pools, CASE["decode"], 2, rng)
    with pytest.raises(InvalidInputError, match="init_cuda_graph_state"):
        capture(backend, batch)
    backend.init_cuda_graph_state(MAX_BS, MAX_BS * VERIFY_WIDTH)
    with pytest.raises(InvalidInputError, match="call init_forward_metadata_capture_cuda_graph first"):
        replay(backend, batch)
    with pytest.raises(UnsupportedModeError, match="got EXTEND"):
        capture(backend, draw_batch(pools, CASE["extend_prefix"], 2, rng))
    with pytest.raises(InvalidInputError, match="0 < bs <= 6"):
        capture(backend, pad_for_graph(batch, MAX_BS + 1, 1))
    with pytest.raises(InvalidInputError, match="num_tokens"):
        backend.init_forward_metadata_capture_cuda_graph(
            2, 5, batch.req_pool_indices, batch.seq_lens, None, ForwardMode.DECODE, None
        )


@pytest.mark.triton_cpu  # a triton backend over CPU pools
def test_replay_rejects_a_tree_mask_the_capture_did_not_have():
    rng = random.Random("mask-kind")
    pools = make_pools()
    backend = make_backend("triton", pools)
    backend.init_cuda_graph_state(MAX_BS, MAX_BS * VERIFY_WIDTH)
    capture(backend, draw_batch(pools, CASE["verify"], 2, rng))
    with pytest.raises(InvalidInputError, match="expected no spec_info.custom_mask"):
        replay(backend, draw_batch(pools, CASE["verify_tree_mask"], 2, rng))
    with pytest.raises(InvalidInputError, match="expected 3 tokens per request"):
        backend.init_forward_metadata_replay_cuda_graph(
            2,
            torch.zeros(2, dtype=torch.int64),
            torch.ones(2, dtype=torch.int32),
            2,
            None,
            ForwardMode.TARGET_VERIFY,
            SpecInfo(num_tokens_per_req=2),
            None,
        )


def test_attention_without_metadata_for_the_mode_says_what_is_missing():
    rng = random.Random("no-meta")
    pools = make_pools()
    backend = make_backend("torch", pools)
    decode = draw_batch(pools, CASE["decode"], 2, rng)
    qkv = random_qkv(decode.num_tokens, pools, torch.Generator().manual_seed(0))
    with pytest.raises(InvalidInputError, match="before attention, got none"):
        attend(backend, decode, qkv)
    backend.init_forward_metadata(draw_batch(pools, CASE["verify"], 2, rng))
    with pytest.raises(InvalidInputError, match="got metadata for TARGET_VERIFY"):
        attend(backend, decode, qkv)


# ---- composite --------------------------------------------------------------
@pytest.mark.triton_cpu
def test_composite_routes_layers_and_keeps_every_member_in_step():
    rng = random.Random("composite-route")
    pools = make_pools()
    primary, child = make_backend("torch", pools), make_backend("triton", pools)
    composite = CompositeBackend(primary, [child], layer_routes={1: 0})
    ref = ReferenceBackend(pools.req, pools.kv)
    assert composite.member_for_layer(0) is primary and composite.member_for_layer(1) is child
    batch = draw_batch(pools, CASE["extend_prefix"], 3, rng)
    qkv = random_qkv(batch.num_tokens, pools, torch.Generator().manual_seed(2))
    assert_close(eager(composite, batch, qkv), eager(ref, batch, qkv), 1e-4)
    assert primary.forward_metadata.bs == child.forward_metadata.bs == 3

    composite.init_cuda_graph_state(MAX_BS, MAX_BS)
    assert set(composite.cuda_graph_buffers()) == {
        *(f"primary.{k}" for k in primary.cuda_graph_buffers()),
        *(f"children[0].{k}" for k in child.cuda_graph_buffers()),
    }


def test_composite_rejects_children_on_other_pools_and_bad_routes():
    pools, other = make_pools(), make_pools()
    primary = TorchGraphBackend(pools.req, pools.kv)
    with pytest.raises(InvalidInputError, match="primary's KV and request pools"):
        CompositeBackend(primary, [TorchGraphBackend(other.req, other.kv)])
    with pytest.raises(InvalidInputError, match="layer_routes"):
        CompositeBackend(primary, [TorchGraphBackend(pools.req, pools.kv)], layer_routes={0: 1})


def test_composite_serves_only_what_every_member_serves():
    pools = make_pools()
    composite = CompositeBackend(TorchGraphBackend(pools.req, pools.kv), [ReferenceBackend(pools.req, pools.kv)])
    assert composite.supported_modes == ALL_MODES and not composite.supports_cuda_graph


def test_composite_replay_reads_host_lengths_where_any_member_does():
    pools = make_pools()
    graph_safe = [TorchGraphBackend(pools.req, pools.kv), TorchGraphBackend(pools.req, pools.kv)]
    assert not CompositeBackend(graph_safe[0], graph_safe[1:]).replay_reads_host_lengths
    reads = TorchGraphBackend(pools.req, pools.kv)
    reads.replay_reads_host_lengths = True  # as a backend written for SGLang's hook may
    assert CompositeBackend(graph_safe[0], [reads]).replay_reads_host_lengths


def test_a_capture_takes_back_only_its_own_inputs_offer_to_hold_the_fill(monkeypatch):
    """Two graph runners over one backend, each with its own static inputs,
    offer to hold a size's fill in their graphs (``fill_in_graph``): a
    replay over either runner's inputs then fills nothing, and a capture
    over one runner's inputs takes back that runner's offer only. The
    bookkeeping keys on the inputs' addresses, on any device; the fill's
    recording, which is CUDA's, is allowed here, and no stream is capturing."""
    from sgl_piecewise.backends import static_graph

    monkeypatch.setattr(static_graph, "can_record_fill", lambda device, masked: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build has no answer
    backend = graph_backend("torch", ForwardMode.DECODE, make_pools())
    fills = []
    monkeypatch.setattr(backend, "_fill_bound", lambda key, meta, inputs, spec: fills.append(inputs[0].data_ptr()))
    bs = 2
    first, second, other = [(torch.zeros(MAX_BS, dtype=torch.int64), torch.ones(MAX_BS, dtype=torch.int32))
                            for _ in range(3)]  # fmt: skip

    def capture_over(inputs) -> None:
        backend.init_forward_metadata_capture_cuda_graph(bs, bs, *inputs, None, ForwardMode.DECODE, None)
        assert backend.fill_in_graph(ForwardMode.DECODE, bs, *inputs)

    def filled_on_replay(inputs) -> bool:
        fills.clear()
        backend.init_forward_metadata_replay_cuda_graph(bs, *inputs, 2 * bs, None, ForwardMode.DECODE, None)
        return fills == [inputs[0].data_ptr()]

    capture_over(first)
    capture_over(second)
    assert not filled_on_replay(first) and not filled_on_replay(second)
    assert filled_on_replay(other)  # inputs no graph holds the fill for
    backend.init_forward_metadata_capture_cuda_graph(bs, bs, *first, None, ForwardMode.DECODE, None)
    assert filled_on_replay(first)  # its offer taken back until it offers again
    assert not filled_on_replay(second)  # the other runner's stands
