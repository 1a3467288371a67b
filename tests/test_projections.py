"""The projection ops (``ops/projections.py``) and their fused kernels
(``ops/kernels/projection.py``) against plain PyTorch.

On a CPU the kernels run under TRITON_INTERPRET=1, in float32 (the
interpreter rounds bfloat16 by truncating); the ``gpu`` tests run them
compiled, in half precision, eagerly, replayed from a CUDA graph and with
programmatic dependent launch on and off. Sizes are odd on purpose: 1, 3
and 17 rows, widths that are no multiple of a block, every GQA ratio the
shipped shapes use (14 / 2, 32 / 8, 9 / 3, and 4 / 4).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the fused kernels need the `triton` package")

import sgl_piecewise as sp  # noqa: E402
from sgl_piecewise.compile import mark_token_axis  # noqa: E402
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError  # noqa: E402
from sgl_piecewise.internals import pdl  # noqa: E402
from sgl_piecewise.ops import projections  # noqa: E402
from sgl_piecewise.ops.kernels import projection as kernels  # noqa: E402
from sgl_piecewise.ops.kernels.tilings import TABLE_DIR, Tiling, rotary_head_dim, rotary_kind  # noqa: E402

EPS = 1e-6
# Tilings the CPU tests run: tensor-core tiles with and without split K, a
# single row on the CUDA cores, and whole rows in one chunk (block_k > K).
TILINGS = [Tiling(16, 64), Tiling(16, 32, split_k=4), Tiling(8, 64, split_k=2, fma=True), Tiling(2, 256, fma=True)]
GQA = [(14, 2), (32, 8), (9, 3), (4, 4)]


def rms_norm(x, w):
    xf = x.double()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def ref_linear(x, w, bias=None, residual=None, norm=None):
    y = (x.double() if norm is None else rms_norm(x, norm)) @ w.double().T
    y = y if bias is None else y + bias.double()
    return y if residual is None else y + residual.double()


def ref_gate_up(x, w, norm=None):
    gate, up = ref_linear(x, w, norm=norm).chunk(2, dim=-1)
    return F.silu(gate) * up


def ref_qkv(x, w, bias, positions, cache, hq, hkv, norm=None):
    d = cache.shape[1]
    qk, v = ref_linear(x, w, bias, norm=norm).split([(hq + hkv) * d, hkv * d], dim=-1)
    qk = qk.view(-1, hq + hkv, d)
    cos, sin = cache.double()[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = qk.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1), v.view(-1, hkv, d)


def rel_err(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _inputs(rows, k, n, device="cpu", dtype=torch.float32):
    x = torch.randn(rows, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    norm = (1 + 0.2 * torch.randn(k, device=device)).to(dtype)
    return x, w, norm


# ---- the kernels, on the CPU under the interpreter -----------------------


@pytest.mark.triton_cpu
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("tiling", TILINGS, ids=str)
def test_fused_linear_equals_the_plain_ops(rows, tiling):
    x, w, norm = _inputs(rows, 200, 72)  # 200: no multiple of any block_k; 72: of no block_n
    bias, residual = torch.randn(72), torch.randn(rows, 72)
    got = kernels.linear(x, w, bias, residual, norm, EPS, tiling=tiling)
    assert rel_err(got, ref_linear(x, w, bias, residual, norm)) < 1e-6
    logits = kernels.linear(x, w, out_dtype=torch.float32, tiling=tiling)
    assert logits.dtype == torch.float32 and rel_err(logits, ref_linear(x, w)) < 1e-6


@pytest.mark.triton_cpu
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("tiling", TILINGS, ids=str)
def test_fused_gate_up_silu_equals_the_plain_ops(rows, tiling):
    x, w, norm = _inputs(rows, 136, 2 * 40)
    assert rel_err(kernels.gate_up_silu(x, w, norm, EPS, tiling=tiling), ref_gate_up(x, w, norm)) < 1e-6
    assert rel_err(kernels.gate_up_silu(x, w, tiling=tiling), ref_gate_up(x, w)) < 1e-6


@pytest.mark.triton_cpu
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("heads", GQA, ids=str)
def test_fused_qkv_rope_equals_the_plain_ops_for_every_gqa_ratio(rows, heads):
    hq, hkv = heads
    d = 16
    x, w, norm = _inputs(rows, 96, (hq + 2 * hkv) * d)
    bias = torch.randn((hq + 2 * hkv) * d)
    positions, cache = torch.randint(0, 40, (rows,)), torch.randn(40, d)
    tiling = TILINGS[rows % len(TILINGS)]  # each tiling on some row count
    qk, v = kernels.qkv_rope(x, w, bias, positions, cache, hq, hkv, d, norm, EPS, tiling=tiling)
    want_qk, want_v = ref_qkv(x, w, bias, positions, cache, hq, hkv, norm)
    assert qk.shape == (rows, hq + hkv, d) and v.shape == (rows, hkv, d)
    assert rel_err(qk, want_qk) < 1e-6 and rel_err(v, want_v) < 1e-6


@pytest.mark.triton_cpu
def test_every_shipped_table_names_kinds_the_ops_ask_for():
    """Keys are ``<kind>:<n>:<k>``; a QKV kind names its head size, read back as written."""
    assert rotary_head_dim(rotary_kind(80)) == 80 and rotary_head_dim("linear") is None
    tables = sorted(TABLE_DIR.glob("*.json"))
    assert tables
    for table in tables:
        for key in json.loads(table.read_text())["tilings"]:
            kind, n, k = key.split(":")
            assert kind in ("linear", "silu") or rotary_head_dim(kind) in (64, 128), (table.name, key)
            assert int(n) > 0 and int(k) > 0


def test_a_split_leaves_its_arrival_counts_zero():
    x, w, _ = _inputs(3, 256, 64)
    kernels.linear(x, w, tiling=Tiling(16, 32, split_k=4))
    assert not kernels._split_counters(x.device).any()


# ---- the ops: plain path, checks, tracing --------------------------------


def test_the_ops_on_a_cpu_are_the_plain_formulas():
    x, w, norm = _inputs(5, 64, 48)
    residual = torch.randn(5, 48)
    torch.testing.assert_close(sp.ops.linear(x, w, residual=residual), residual + F.linear(x, w))
    logits = sp.ops.linear(x, w, float32_out=True)
    assert logits.dtype == torch.float32 and rel_err(logits, ref_linear(x, w)) < 1e-6
    assert rel_err(sp.ops.gate_up_silu(x, w, norm_weight=norm, eps=EPS), ref_gate_up(x, w, norm)) < 1e-6
    positions, cache = torch.randint(0, 30, (5,)), torch.randn(30, 8)
    qk, v = sp.ops.qkv_rope(x, w, None, positions, cache, num_heads=2, num_kv_heads=2, norm_weight=norm, eps=EPS)
    want_qk, want_v = ref_qkv(x, w, None, positions, cache, 2, 2, norm)
    assert rel_err(qk, want_qk) < 1e-6 and rel_err(v, want_v) < 1e-6
    assert qk.is_contiguous() and v.is_contiguous()  # as the fake implementation says


def test_the_ops_refuse_a_wrong_dtype_shape_or_device_by_name():
    x, w, norm = _inputs(3, 64, 48)
    with pytest.raises(InvalidInputError, match=r"weight: expected dtype torch.float32, got torch.bfloat16"):
        sp.ops.linear(x, w.bfloat16())
    with pytest.raises(InvalidInputError, match=r"weight: expected shape \[\*, 64\], got \[48, 63\]"):
        sp.ops.linear(x, w[:, :63])
    with pytest.raises(InvalidInputError, match=r"residual: expected shape \[3, 48\], got \[2, 48\]"):
        sp.ops.linear(x, w, residual=torch.zeros(2, 48))
    with pytest.raises(InvalidInputError, match="expected no residual with float32 logits"):
        sp.ops.linear(x, w, residual=torch.zeros(3, 48), float32_out=True)
    with pytest.raises(InvalidInputError, match=r"x: expected shape \[\*, \*\], got \[3, 4, 16\]"):
        sp.ops.gate_up_silu(x.view(3, 4, 16), w)
    with pytest.raises(InvalidInputError, match=r"gate_up_silu: expected weight \[2F, H\]"):
        sp.ops.gate_up_silu(x, w[:47])
    with pytest.raises(InvalidInputError, match=r"norm_weight: expected shape \[64\], got \[63\]"):
        sp.ops.gate_up_silu(x, w, norm_weight=norm[:63])
    positions, cache = torch.zeros(3, dtype=torch.int64), torch.randn(30, 8)
    with pytest.raises(InvalidInputError, match=r"weight: expected shape \[48, \*\], got \[40, 64\]"):
        sp.ops.qkv_rope(x, w[:40], None, positions, cache, num_heads=2, num_kv_heads=2)
    with pytest.raises(InvalidInputError, match="num_heads a positive multiple of num_kv_heads"):
        sp.ops.qkv_rope(x, w, None, positions, cache, num_heads=3, num_kv_heads=2)
    with pytest.raises(InvalidInputError, match=r"positions: expected dtype torch.int32 or torch.int64"):
        sp.ops.qkv_rope(x, w, None, positions.float(), cache, num_heads=2, num_kv_heads=2)
    with pytest.raises(InvalidInputError, match=r"weight: expected device meta, got cpu"):
        sp.ops.linear(x.to("meta"), w)
    with pytest.raises(InvalidTypeError, match="x: expected a torch.Tensor, got list"):
        sp.ops.linear([[1.0]], w)


def _mark_dynamic(*tensors):
    for t in tensors:
        torch._dynamo.mark_dynamic(t, 0)


@pytest.mark.parametrize(
    "mark, counts",
    [(_mark_dynamic, (5, 2, 9)), (mark_token_axis, (1, 5, 2))],
    ids=["backed", "unbacked-from-one-token"],
)
def test_the_ops_trace_with_no_graph_break_and_no_recompile_across_token_counts(fresh_dynamo, mark, counts):
    # Unbacked, x's and positions' token counts are two symbols the ops must not guard on.
    _, w, norm = _inputs(1, 64, 48)
    w_down = torch.randn(64, 24)
    positions_cache = torch.randn(30, 8)

    def step(x, positions):
        qk, v = sp.ops.qkv_rope(x, w, None, positions, positions_cache, num_heads=2, num_kv_heads=2, norm_weight=norm)
        act = sp.ops.gate_up_silu(x, w, norm_weight=norm)  # [T, 24]
        return sp.ops.linear(act, w_down, residual=x), qk, v

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for rows in counts:
        x, positions = torch.randn(rows, 64), torch.randint(0, 30, (rows,))
        mark(x, positions)
        for got, want in zip(compiled(x, positions), step(x, positions)):
            torch.testing.assert_close(got, want)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames == 1  # one trace serves every count


# ---- on the GPU -----------------------------------------------------------

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _cuda_cases(rows, dtype):
    x, w_qkv, norm = _inputs(rows, 896, (14 + 2 * 2) * 64, "cuda", dtype)
    w_gate_up = (torch.randn(2 * 4864, 896, device="cuda") / 30).to(dtype)
    w_down = (torch.randn(896, 4864, device="cuda") / 70).to(dtype)
    bias = torch.randn(w_qkv.shape[0], device="cuda").to(dtype)
    positions = torch.randint(0, 4096, (rows,), device="cuda")
    cache = torch.randn(4096, 64, device="cuda").to(dtype)
    return x, w_qkv, norm, w_gate_up, w_down, bias, positions, cache


def _layer(x, w_qkv, norm, w_gate_up, w_down, bias, positions, cache):
    """A decoder layer's projections back to back (attention left out)."""
    qk, v = sp.ops.qkv_rope(x, w_qkv, bias, positions, cache, num_heads=14, num_kv_heads=2, norm_weight=norm)
    h = sp.ops.linear(qk.flatten(1)[:, :896], w_down[:, :896].contiguous(), residual=x)
    return sp.ops.linear(sp.ops.gate_up_silu(h, w_gate_up, norm_weight=norm), w_down, residual=h), v


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_the_fused_ops_on_cuda_agree_with_float64(rows, dtype):
    x, w_qkv, norm, w_gate_up, w_down, bias, positions, cache = _cuda_cases(rows, dtype)
    qk, v = sp.ops.qkv_rope(x, w_qkv, bias, positions, cache, num_heads=14, num_kv_heads=2, norm_weight=norm)
    want_qk, want_v = ref_qkv(x, w_qkv, bias, positions, cache, 14, 2, norm)
    assert rel_err(qk, want_qk) < TOL[dtype] and rel_err(v, want_v) < TOL[dtype]
    act = sp.ops.gate_up_silu(x, w_gate_up, norm_weight=norm)
    assert rel_err(act, ref_gate_up(x, w_gate_up, norm)) < TOL[dtype]
    h = torch.randn(rows, 896, device="cuda").to(dtype)
    assert rel_err(sp.ops.linear(act, w_down, residual=h), ref_linear(act, w_down, residual=h)) < TOL[dtype]
    logits = sp.ops.linear(h, w_gate_up, float32_out=True)
    assert logits.dtype == torch.float32 and rel_err(logits, ref_linear(h, w_gate_up)) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_a_replayed_graph_gives_eagers_bits_with_and_without_pdl(rows, monkeypatch):
    cases = _cuda_cases(rows, torch.bfloat16)
    eager = _layer(*cases)
    for switch in ("1", "0"):
        monkeypatch.setenv(pdl.ENV_SWITCH, switch)
        _layer(*cases)  # warm: compiles, allocates the split counts
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _layer(*cases)
        for fill in (0.0, float("nan")):  # a replay writes every element
            for t in out:
                t.fill_(fill)
            graph.replay()
            for got, want in zip(out, eager):
                assert torch.equal(got, want)


@pytest.mark.gpu
def test_pdl_is_on_for_hopper_with_this_triton():
    on_hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert pdl.enabled(torch.device("cuda")) == (on_hopper and pdl.AVAILABLE)
    if on_hopper:
        assert pdl.AVAILABLE, pdl.UNAVAILABLE_REASON


@pytest.mark.gpu
def test_large_and_float32_calls_take_the_plain_ops_on_cuda():
    x, w, norm = _inputs(kernels.MAX_ROWS + 1, 256, 96, "cuda", torch.bfloat16)
    residual = torch.randn(x.shape[0], 96, device="cuda").to(torch.bfloat16)
    assert not projections._fused(x, w)
    assert rel_err(sp.ops.linear(x, w, residual=residual), ref_linear(x, w, residual=residual)) < 1e-2
    x32, w32 = x.float()[:4], w.float()
    assert not projections._fused(x32, w32)
    assert rel_err(sp.ops.gate_up_silu(x32, w32, norm_weight=norm.float()), ref_gate_up(x32, w32, norm)) < 1e-5


# ---- the model's fused route ------------------------------------------------


def _greedy(model, graphs: str, device: str, backend: str, prompts) -> list:
    from sgl_piecewise.engine.runner import ModelRunner

    runner = ModelRunner(model, max_reqs=8, max_context_len=96, backend=backend, graphs=graphs)
    return runner.generate(prompts, max_new_tokens=12)


def test_the_fused_route_gives_the_plain_routes_greedy_tokens_on_a_cpu():
    from sgl_piecewise.models import build_random_model, default_config, set_fused_projections

    model = build_random_model(default_config(), torch.float32, "cpu", seed=3)
    prompts = [[int(t) for t in torch.randint(0, 200, (n,))] for n in (5, 1, 9)]
    plain = _greedy(model, "none", "cpu", "torch", prompts)
    assert set_fused_projections(model, True) > model.config.num_hidden_layers
    assert _greedy(model, "none", "cpu", "torch", prompts) == plain


def test_fused_projections_are_refused_for_a_bad_flag():
    from sgl_piecewise.models import build_random_model, default_config, set_fused_projections

    with pytest.raises(InvalidTypeError, match="enabled: expected a bool, got 1"):
        set_fused_projections(build_random_model(default_config(), torch.float32, "cpu"), 1)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ["full", "breakable", "piecewise", "auto"])
def test_every_graph_policy_gives_eagers_tokens_through_the_fused_route(graphs):
    from sgl_piecewise.models import build_random_model, default_config, set_fused_projections

    model = build_random_model(default_config(), torch.bfloat16, "cuda", seed=3)
    set_fused_projections(model, True)
    prompts = [[int(t) for t in torch.randint(0, 200, (n,))] for n in (5, 1, 9, 17, 3, 12, 7)]
    assert _greedy(model, graphs, "cuda", "triton", prompts) == _greedy(model, "none", "cuda", "triton", prompts)
