"""The all-reduce + residual add + RMSNorm op (``models/norm.py``), its
FlashInfer workspace (``distributed/fused_norm.py``) and where a model
takes it.

On two CPU ranks (gloo) the op runs its unfused path: a model whose
projections are made to take the op anyway gives one rank's tokens under
the graph policies, so the op traces as one node and is captured inside
the pieces and the whole-model graphs. On two GPUs (with FlashInfer) the
op (the fused kernel for narrow rows, its all-reduce then the add + norm
kernel for wide ones) gives the separate ops' stream exactly and their
norm within a rounding, eagerly and replayed from a CUDA graph, and a
larger step falls back.
"""

from __future__ import annotations

import pytest
import torch

from sgl_piecewise.distributed import TensorParallel, comm_ops, fused_norm, launch, prepare_communication, registry
from sgl_piecewise.distributed import tensor_parallel as current_group
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.errors import InvalidTypeError
from sgl_piecewise.models import build_random_model, default_config
from sgl_piecewise.models.norm import fuse_all_reduce_norms, rms_norm


def test_the_kernel_takes_rows_of_16_byte_vectors_in_half_and_single_precision():
    assert fused_norm.shape_ok(896, torch.bfloat16) and fused_norm.shape_ok(4096, torch.float16)
    assert fused_norm.shape_ok(4, torch.float32)
    assert not fused_norm.shape_ok(6, torch.float32)  # 24 bytes
    assert not fused_norm.shape_ok(12, torch.bfloat16)
    assert not fused_norm.shape_ok(896, torch.float64)


def test_rows_up_to_the_measured_width_take_the_fused_kernel_and_wider_ones_the_all_reduce_alone():
    assert fused_norm.fuses_norm(896, torch.bfloat16)  # 1792 bytes: the 0.5B shape
    assert not fused_norm.fuses_norm(4096, torch.bfloat16)  # 8192 bytes: the 8B shape
    widest = fused_norm.FUSED_MAX_ROW_BYTES // 4
    assert fused_norm.fuses_norm(widest, torch.float32) and not fused_norm.fuses_norm(widest + 4, torch.float32)


def test_a_group_fuses_only_several_ranks_on_cuda_with_the_stream_whole(monkeypatch):
    monkeypatch.setattr(fused_norm, "AVAILABLE", True)
    two = TensorParallel(rank=0, size=2, group_name="g")
    assert two.fuses_all_reduce_norm(896, torch.bfloat16, "cuda")
    assert two.fuses_all_reduce_norm(896, torch.float32, torch.device("cuda", 1))
    assert not two.fuses_all_reduce_norm(896, torch.bfloat16, "cpu")
    assert not two.fuses_all_reduce_norm(896, torch.bfloat16, None)
    assert not two.fuses_all_reduce_norm(6, torch.float32, "cuda")
    assert not TensorParallel(rank=0, size=1, group_name="").fuses_all_reduce_norm(896, torch.bfloat16, "cuda")
    split = TensorParallel(rank=0, size=2, group_name="g", sequence_parallel=True)
    assert not split.fuses_all_reduce_norm(896, torch.bfloat16, "cuda")
    monkeypatch.setattr(fused_norm, "AVAILABLE", False)
    assert not two.fuses_all_reduce_norm(896, torch.bfloat16, "cuda")


def test_a_model_on_a_cpu_never_takes_the_op_and_the_switch_counts_what_can():
    model = build_random_model(default_config(), torch.float32, "cpu", seed=0)
    assert fuse_all_reduce_norms(model, True) == 0  # one rank: nothing to fuse
    with pytest.raises(InvalidTypeError, match="enabled: expected a bool, got 'yes'"):
        fuse_all_reduce_norms(model, "yes")


def test_the_fake_implementation_gives_two_tensors_of_the_residual_s_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        p = torch.empty(5, 64, dtype=torch.bfloat16)
        x, h = torch.ops.sgl_piecewise.all_reduce_add_rms_norm(p, p, torch.empty(64, dtype=torch.bfloat16), 1e-6, "g")
        assert x.shape == h.shape == (5, 64) and x.dtype == h.dtype == torch.bfloat16


# ---- two CPU ranks ----------------------------------------------------------------
def _op_values_and_trace() -> dict:
    """The op against the separate ops it stands for, eagerly and compiled
    whole (``fullgraph``: no graph break)."""
    tp = current_group()
    gen = torch.Generator().manual_seed(tp.rank)
    partial, residual = torch.randn(5, 64, generator=gen), torch.randn(5, 64)
    weight = torch.linspace(0.5, 1.5, 64)

    def op(p, r):
        return torch.ops.sgl_piecewise.all_reduce_add_rms_norm(p, r, weight, 1e-6, tp.group_name)

    x, h = op(partial, residual)
    want_x = residual + tp.all_reduce(partial)
    compiled = torch.compile(op, backend="eager", fullgraph=True)
    cx, ch = compiled(partial, residual)
    return {"x": torch.equal(x, want_x), "h": torch.equal(h, rms_norm(want_x, weight, 1e-6)),
            "compiled": torch.equal(cx, x) and torch.equal(ch, h)}  # fmt: skip


def _tokens_through_the_op(prompts: list, new_tokens: int) -> dict:
    """Greedy tokens with every row-parallel projection taking the op (its
    unfused path on the CPU), under the policies that trace the model. The
    group is told it can fuse, as a CUDA group with FlashInfer is: the model
    then calls the op, which finds no workspace and runs its separate ops."""
    TensorParallel.fuses_all_reduce_norm = lambda self, *args: self.size > 1 and not self.splits_sequence
    model = build_random_model(default_config(), torch.float32, "cpu", seed=0)
    able = fuse_all_reduce_norms(model, True)
    tokens = {}
    for policy in ("none", "full", "piecewise"):
        runner = ModelRunner(model, max_reqs=8, max_context_len=96, backend="torch", graphs=policy)
        runner.capture_graphs(progress=False, capture_bs=(4,), capture_sizes=(4, 16, 48), piece_compiler="eager")
        tokens[policy] = runner.generate(prompts, new_tokens, progress=False)
    return {"able": able, "tokens": tokens, "op": _op_values_and_trace()}


def test_two_cpu_ranks_through_the_op_give_one_ranks_tokens_and_its_exact_sums():
    prompts = [[3, 17, 250, 9], [41, 7], [1000, 2, 3, 4, 5, 6, 7]]
    model = build_random_model(default_config(), torch.float32, "cpu", seed=0)
    want = ModelRunner(model, max_reqs=8, max_context_len=96, backend="torch").generate(prompts, 6, progress=False)
    layers = default_config().num_hidden_layers
    for r, result in enumerate(launch(_tokens_through_the_op, 2, prompts, 6, timeout_s=600)):
        assert result["able"] == 2 * layers, f"rank {r}"
        assert result["op"] == {"x": True, "h": True, "compiled": True}, f"rank {r}"
        for policy, tokens in result["tokens"].items():
            assert tokens == want, f"rank {r}, graphs={policy}"


def _one_rank_cannot_build() -> dict:
    """FlashInfer's build fails on rank 1 alone: what each rank then holds
    and what rank 0 was told (a failure injected into the real group)."""
    import logging

    from sgl_piecewise.distributed import groups

    tp = current_group()
    # As where FlashInfer is installed and its kernel takes the rows (on CUDA).
    groups.TensorParallel.fuses_all_reduce_norm = lambda self, hidden_size, dtype, device: True

    def build():
        if tp.rank == 1:
            raise RuntimeError("nvcc not found")

    fused_norm.build = build
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("sgl_piecewise.distributed").addHandler(handler)
    groups._prepare_fused_norm(tp, 8, 64, torch.bfloat16, "cpu")
    return {"workspaces": len(registry.workspaces(tp.group_name)), "said": said}


def test_where_one_rank_cannot_build_the_kernels_no_rank_allocates_and_each_says_which():
    for r, result in enumerate(launch(_one_rank_cannot_build, 2, timeout_s=120)):
        assert result["workspaces"] == 0, f"rank {r}"
        assert any("rank 1: RuntimeError: nvcc not found" in m and "separate kernels serve" in m
                   for m in result["said"]), (r, result["said"])  # fmt: skip


# ---- two GPUs ---------------------------------------------------------------------
# The 0.5B shape's rows (the fused kernel) and the 8B shape's (its all-reduce,
# then the add + norm kernel); the workspace holds MOST tokens.
HIDDENS, MOST = (896, 4096), 64


def _fused_against_separate() -> list:
    """Per dtype and token count (the last one past the workspace): whether
    the fused kernel served, the largest difference of the stream and of the
    norm from the separate ops', eagerly and replayed from a CUDA graph."""
    tp = current_group()
    rows = []
    for hidden in HIDDENS:
        for dtype in (torch.bfloat16, torch.float32):
            prepare_communication(MOST, hidden, dtype, tp.device)
            held = _held(hidden, dtype)
            for tokens in (1, 7, held, held + 1):
                rows.append(_fused_case(tp, hidden, dtype, tokens))
    return rows


def _held(hidden: int, dtype: torch.dtype) -> int:
    """The tokens a workspace prepared for MOST holds at this width: no more
    than the fused kernel is measured faster at."""
    return min(MOST, fused_norm.MAX_BYTES // (hidden * dtype.itemsize))


def _fused_case(tp, hidden: int, dtype: torch.dtype, tokens: int) -> dict:
    gen = torch.Generator(device=tp.device).manual_seed(tp.rank)
    weight = torch.linspace(0.5, 1.5, hidden, device=tp.device, dtype=dtype)

    def inputs() -> tuple:  # this rank's partial sums; the residual, the same on every rank
        partial = torch.randn(tokens, hidden, device=tp.device, generator=gen).to(dtype)
        return partial, torch.linspace(-1, 1, tokens * hidden, device=tp.device).view(tokens, hidden).to(dtype)

    def op(p, r):
        return torch.ops.sgl_piecewise.all_reduce_add_rms_norm(p, r, weight, 1e-6, tp.group_name)

    def separate(p, r):
        x = r + tp.all_reduce(p)
        return x, rms_norm(x, weight, 1e-6)

    served = fused_norm.serving(tp.group_name, torch.empty(tokens, hidden, dtype=dtype, device=tp.device))
    p, r = inputs()
    eager = _gaps(op(p, r), separate(p, r))
    static_p, static_r = p.clone(), r.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(static_p, static_r)  # warm-up off the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(static_p, static_r)
    replayed = []
    for _ in range(2):
        p, r = inputs()
        static_p.copy_(p)
        static_r.copy_(r)
        graph.replay()
        replayed.append(_gaps(out, separate(p, r)))
    return {"hidden": hidden, "dtype": str(dtype), "tokens": tokens, "held": _held(hidden, dtype),
            "served": served is not None,
            "fused": fused_norm.fuses_norm(hidden, dtype), "eager": eager, "replayed": max(replayed)}  # fmt: skip


def _gaps(got: tuple, want: tuple) -> tuple:
    """(largest |x - x'|, largest |h - h'| over the norm's largest value)."""
    (x, h), (wx, wh) = got, want
    return (x.float() - wx.float()).abs().max().item(), ((h.float() - wh.float()).abs().max() / wh.abs().max()).item()


@pytest.mark.gpu
def test_gpu_the_fused_kernel_gives_the_separate_ops_sums_eagerly_and_in_cuda_graphs():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, got {torch.cuda.device_count()}")
    if not fused_norm.AVAILABLE:
        pytest.skip("needs the flashinfer package")
    rows = launch(_fused_against_separate, 2, device="cuda", timeout_s=600)[0]
    assert {row["fused"] for row in rows} == {True, False}  # both paths of the op ran
    for row in rows:
        assert row["served"] == (row["tokens"] <= row["held"]), row
        # The stream: the same sums rounded once, both ways. The norm: one
        # rounding less (half precision), or the squares summed in another order.
        tol = 2**-7 if row["dtype"] == "torch.bfloat16" else 1e-6
        for gaps in (row["eager"], row["replayed"]):
            assert gaps[0] == 0 and gaps[1] <= tol, row


def test_the_registry_drops_a_group_s_workspaces_with_the_group():
    released = []

    class Held:
        def release(self):
            released.append(self)

    held = Held()
    registry.add_workspace("test-group", held)
    assert registry.workspaces("test-group") == [held]
    registry.forget_group("test-group")
    assert registry.workspaces("test-group") == [] and released == [held]


def test_the_op_reads_whether_all_reduces_are_sent_through_nccl_only():
    assert not comm_ops.nccl_only()
    with comm_ops.nccl_only_all_reduces():
        assert comm_ops.nccl_only()
    assert not comm_ops.nccl_only()
