"""Every backend against the reference backend, in every forward mode, eager
and through the capture/replay hooks, on fresh random ragged batches.

The graph path captures with one batch and replays with a different, fresh
batch at the same padded batch size. On the CPU "capture" means: the capture
hook, a forward on the static metadata, then the replay hook for the new batch
and a forward on the same static metadata; the GPU tests at the end capture a
real ``torch.cuda.CUDAGraph`` around the attention op and replay it.

This module also holds the batch builders the other backend test modules use.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Optional, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_piecewise import ForwardBatch, ForwardMode, KVPool, ReqToTokenPool, SpecInfo, forward_context
from sgl_piecewise.backends import ReferenceBackend, create_backend
from sgl_piecewise.engine.testing import random_batch
from sgl_piecewise.memory import DUMMY_SLOT
from sgl_piecewise.ops import unified_attention

HQ, HKV, D = 4, 2, 16  # grouped heads (2 per kv head); D=16: the smallest tl.dot tile
CONTEXT = 80  # req_to_token row length: the graph key extent
MAX_BS = 6
VERIFY_WIDTH = 3  # draft tokens per request (TARGET_VERIFY, DRAFT_EXTEND_V2)
NUM_LAYERS = 2


@dataclass(frozen=True)
class Case:
    id: str
    mode: ForwardMode
    masked: bool = False  # TARGET_VERIFY with a tree mask
    prefix: bool = True  # EXTEND on top of a cached prefix


CASES = [
    Case("extend_no_prefix", ForwardMode.EXTEND, prefix=False),
    Case("extend_prefix", ForwardMode.EXTEND),
    Case("decode", ForwardMode.DECODE),
    Case("mixed", ForwardMode.MIXED),
    Case("idle", ForwardMode.IDLE),
    Case("verify", ForwardMode.TARGET_VERIFY),
    Case("verify_tree_mask", ForwardMode.TARGET_VERIFY, masked=True),
    Case("draft_extend_v1", ForwardMode.DRAFT_EXTEND),
    Case("draft_extend_v2", ForwardMode.DRAFT_EXTEND_V2),
]
GRAPH_CASES = [c for c in CASES if c.mode.is_cuda_graph()]


# ---- builders (used by the other backend test modules too) -------------------
@dataclass
class Pools:
    req: ReqToTokenPool
    kv: KVPool


def make_pools(device="cpu", dtype=torch.float32, head_dim=D, max_reqs=4 * MAX_BS + 4, slots=4096) -> Pools:
    return Pools(ReqToTokenPool(max_reqs, CONTEXT, device), KVPool(slots, NUM_LAYERS, HKV, head_dim, dtype, device))


def make_backend(name: str, pools: Pools):
    if name in ("triton", "flashinfer"):  # the gpu extra; CPU CI may lack it
        pytest.importorskip(name)
    return create_backend(name, pools.req, pools.kv, num_q_heads=HQ)


def graph_width(mode: ForwardMode) -> int:
    return VERIFY_WIDTH if mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2) else 1


def graph_backend(name: str, mode: ForwardMode, pools: Pools):
    """A backend with static buffers for up to ``MAX_BS`` graph requests of ``mode``."""
    backend = make_backend(name, pools)
    init_graph_state(backend, mode)
    return backend


def init_graph_state(backend, mode: ForwardMode) -> None:
    backend.init_cuda_graph_state(MAX_BS, MAX_BS * graph_width(mode))


def _prefix(rng: random.Random, longest: int, at_least: int = 0) -> int:
    """Skewed: empty, short, or long cached prefixes in one batch."""
    kind = rng.choice(("empty", "short", "long"))
    if kind == "empty":
        return at_least
    if kind == "short":
        return rng.randint(max(1, at_least), 8)
    return rng.randint(max(40, at_least), longest)


def draw_lengths(case: Case, bs: int, rng: random.Random) -> Tuple[List[int], List[int]]:
    """``(prefix_lens, extend_lens)`` for ``bs`` fresh requests of ``case``."""
    mode, s = case.mode, VERIFY_WIDTH
    if mode.is_idle():
        return [], []
    if mode == ForwardMode.EXTEND:
        ext = [rng.randint(1, 12) for _ in range(bs)]
        pre = [_prefix(rng, CONTEXT - 12) if case.prefix else 0 for _ in range(bs)]
        return pre, ext
    if mode == ForwardMode.MIXED:  # prefill chunks first, then decodes (SGLang's order)
        chunks = max(1, bs // 2)
        ext = [rng.randint(2, 8) for _ in range(chunks)] + [1] * (bs - chunks)
        pre = [_prefix(rng, CONTEXT - 8, at_least=0 if i < chunks else 1) for i in range(bs)]
        return pre, ext
    if mode == ForwardMode.DECODE:
        return [_prefix(rng, CONTEXT - 1) for _ in range(bs)], [1] * bs
    if mode == ForwardMode.DRAFT_EXTEND:  # ragged accepted lengths
        return [_prefix(rng, CONTEXT - s, at_least=1) for _ in range(bs)], [rng.randint(1, s) for _ in range(bs)]
    return [_prefix(rng, CONTEXT - s, at_least=1) for _ in range(bs)], [s] * bs


def tree_mask_block(prefix: int, width: int, rng: Optional[random.Random]) -> torch.Tensor:
    """``[width, prefix + width]`` bool: all of the prefix, then a random tree
    over the drafts (each sees its ancestors and itself); causal without rng."""
    vis = torch.zeros(width, prefix + width, dtype=torch.bool)
    vis[:, :prefix] = True
    for i in range(width):
        parent = (rng.randrange(-1, i) if rng is not None else i - 1) if i else -1
        if parent >= 0:
            vis[i, prefix:] = vis[parent, prefix:]
        vis[i, prefix + i] = True
    return vis.flatten()


def make_spec(case: Case, prefix: List[int], ext: List[int], rng: random.Random) -> Optional[SpecInfo]:
    mode = case.mode
    if mode == ForwardMode.DRAFT_EXTEND:
        return SpecInfo(accept_lengths=torch.tensor(ext, dtype=torch.int32))
    if mode not in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2):
        return None
    mask = None
    if case.masked:
        blocks = [tree_mask_block(p, VERIFY_WIDTH, rng) for p in prefix]
        mask = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool)
    return SpecInfo(num_tokens_per_req=VERIFY_WIDTH, custom_mask=mask)


def draw_batch(pools: Pools, case: Case, bs: int, rng: random.Random) -> ForwardBatch:
    prefix, ext = draw_lengths(case, bs, rng)
    spec = make_spec(case, prefix, ext, rng)
    if spec is not None and spec.custom_mask is not None:
        spec.custom_mask = spec.custom_mask.to(pools.kv.device)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    return random_batch(case.mode, pools.req, pools.kv, prefix, ext, spec_info=spec, generator=gen)


def pad_for_graph(batch: ForwardBatch, padded_bs: int, fill: int) -> ForwardBatch:
    """``batch`` padded to ``padded_bs`` requests as a graph runner pads it:
    padded requests have ``seq_len = fill``, row 0 of the request table, a
    full-width query whose tokens write to the dummy slot, and (tree-masked
    verify) a causal mask block."""
    mode, bs, n = batch.forward_mode, batch.batch_size, batch.num_tokens
    pad, width = padded_bs - bs, graph_width(mode)
    dev = batch.seq_lens.device

    def cat(t, value, count, dtype):
        return torch.cat([t.to(dtype), torch.full((count,), value, dtype=dtype, device=t.device)])

    seq_cpu = cat(batch.seq_lens_cpu, fill, pad, torch.int32)
    ext_cpu = list(batch.extend_seq_lens_cpu) + [width] * pad
    pad_prefix = fill if mode.seq_lens_exclude_new_tokens() else fill - width
    prefix_cpu = list(batch.extend_prefix_lens_cpu) + [pad_prefix] * pad
    spec = batch.spec_info
    if spec is not None and spec.custom_mask is not None:
        extra = [tree_mask_block(pad_prefix, width, None).to(dev) for _ in range(pad)]
        spec = SpecInfo(spec.num_tokens_per_req, spec.accept_lengths, torch.cat([spec.custom_mask, *extra]))
    return ForwardBatch(
        forward_mode=mode,
        batch_size=padded_bs,
        input_ids=cat(batch.input_ids[:n], 0, pad * width, torch.int64),
        positions=cat(batch.positions[:n], 0, pad * width, torch.int64),
        seq_lens=seq_cpu.to(dev),
        seq_lens_cpu=seq_cpu,
        extend_seq_lens=torch.tensor(ext_cpu, dtype=torch.int32, device=dev),
        extend_prefix_lens=torch.tensor(prefix_cpu, dtype=torch.int32, device=dev),
        req_pool_indices=cat(batch.req_pool_indices, 0, pad, torch.int64),
        out_cache_loc=cat(batch.out_cache_loc[:n], DUMMY_SLOT, pad * width, torch.int64),
        extend_seq_lens_cpu=ext_cpu,
        extend_prefix_lens_cpu=prefix_cpu,
        num_token_non_padded=torch.tensor(n, dtype=torch.int32, device=dev),
        spec_info=spec,
    )


def random_qkv(num_tokens: int, pools: Pools, gen: torch.Generator):
    """One ``(q, k, v)`` per layer, ``[num_tokens, H, D]`` in the pool's dtype."""
    dev, dtype, head_dim = pools.kv.device, pools.kv.dtype, pools.kv.head_dim

    def draw(heads):
        return torch.randn(num_tokens, heads, head_dim, generator=gen).to(dev, dtype)

    return [(draw(HQ), draw(HKV), draw(HKV)) for _ in range(NUM_LAYERS)]


def attend(backend, batch: ForwardBatch, qkv, check: bool = False) -> List[torch.Tensor]:
    """The real op, every layer, on whatever metadata ``backend`` holds now.

    ``check=False`` by default: graph-path batches are padded the way a graph
    runner pads its static batch (padded requests share row 0 and write the
    dummy slot), which the context's caller-batch validation would refuse.
    """
    with forward_context(batch, backend, check=check):
        return [unified_attention(q, k, v, layer_id=i) for i, (q, k, v) in enumerate(qkv)]


def eager(backend, batch: ForwardBatch, qkv) -> List[torch.Tensor]:
    backend.init_forward_metadata(batch)
    return attend(backend, batch, qkv, check=True)


def capture(backend, batch: ForwardBatch) -> None:
    backend.init_forward_metadata_capture_cuda_graph(
        batch.batch_size,
        batch.num_tokens,
        batch.req_pool_indices,
        batch.seq_lens,
        None,
        batch.forward_mode,
        batch.spec_info,
    )


def replay(backend, batch: ForwardBatch, with_seq_lens_cpu: bool = False) -> None:
    backend.init_forward_metadata_replay_cuda_graph(
        batch.batch_size,
        batch.req_pool_indices,
        batch.seq_lens,
        batch.seq_lens_sum,
        None,
        batch.forward_mode,
        batch.spec_info,
        batch.seq_lens_cpu if with_seq_lens_cpu else None,
    )


def pad_qkv(qkv, batch: ForwardBatch, padded: ForwardBatch, pools: Pools, gen):
    """Real rows, then random rows for the padded requests' tokens."""
    extra = random_qkv(padded.num_tokens - batch.num_tokens, pools, gen)
    return [tuple(torch.cat([a, b]) for a, b in zip(real, pad)) for real, pad in zip(qkv, extra)]


def assert_close(got: List[torch.Tensor], want: List[torch.Tensor], atol: float) -> None:
    for layer, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"layer {layer}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
        err = (g.float() - w.float()).abs().max().item() if g.numel() else 0.0
        assert err <= atol, f"layer {layer}: max abs error {err:.3g} > {atol}"


def graph_step(
    backend, ref, pools: Pools, case: Case, padded_bs: int, rng: random.Random, with_seq_lens_cpu: bool = False
):
    """Capture with one batch, replay with a fresh one; ``(got, want)`` for the
    replayed batch's real tokens (``want`` from the reference, eager)."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    fill = backend.get_cuda_graph_seq_len_fill_value()
    init_graph_state(backend, case.mode)
    real_bs = 0 if case.mode.is_idle() else rng.randint(1, padded_bs)
    first = draw_batch(pools, case, real_bs, rng)
    captured = pad_for_graph(first, padded_bs, fill)
    capture(backend, captured)
    attend(backend, captured, pad_qkv(random_qkv(first.num_tokens, pools, gen), first, captured, pools, gen))

    real_bs = 0 if case.mode.is_idle() else rng.randint(1, padded_bs)
    batch = draw_batch(pools, case, real_bs, rng)
    qkv = random_qkv(batch.num_tokens, pools, gen)
    padded = pad_for_graph(batch, padded_bs, fill)
    replay(backend, padded, with_seq_lens_cpu)
    got = attend(backend, padded, pad_qkv(qkv, batch, padded, pools, gen))
    want = eager(ref, batch, qkv)
    return [g[: batch.num_tokens] for g in got], want


# ---- CPU: torch and triton ------------------------------------------------
CPU_BACKENDS = ["torch", "triton"]
ATOL_F32 = 1e-4


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_eager_matches_reference(name, case):
    rng = random.Random(f"eager-{name}-{case.id}")
    pools = make_pools()
    backend, ref = make_backend(name, pools), ReferenceBackend(pools.req, pools.kv)
    for _ in range(2):  # two fresh batches through the same backend
        bs = 0 if case.mode.is_idle() else rng.randint(1, MAX_BS)
        batch = draw_batch(pools, case, bs, rng)
        qkv = random_qkv(batch.num_tokens, pools, torch.Generator().manual_seed(rng.randrange(2**31)))
        assert_close(eager(backend, batch, qkv), eager(ref, batch, qkv), ATOL_F32)


@pytest.mark.parametrize("case", GRAPH_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_replay_with_a_fresh_batch_matches_reference(name, case):
    rng = random.Random(f"graph-{name}-{case.id}")
    pools = make_pools()
    backend, ref = make_backend(name, pools), ReferenceBackend(pools.req, pools.kv)
    got, want = graph_step(backend, ref, pools, case, padded_bs=4, rng=rng)
    assert_close(got, want, ATOL_F32)


@settings(max_examples=30, deadline=None)
@given(
    case=st.sampled_from([c for c in GRAPH_CASES if not c.mode.is_idle()]),
    padded_bs=st.integers(1, MAX_BS),
    seed=st.integers(0, 2**31 - 1),
    with_seq_lens_cpu=st.booleans(),
)
def test_torch_backend_replay_any_padded_batch(case, padded_bs, seed, with_seq_lens_cpu):
    pools = make_pools()
    backend, ref = make_backend("torch", pools), ReferenceBackend(pools.req, pools.kv)
    got, want = graph_step(backend, ref, pools, case, padded_bs, random.Random(seed), with_seq_lens_cpu)
    assert_close(got, want, ATOL_F32)


# ---- GPU: every backend, eager and a real CUDA graph ------------------------
ATOL_BF16 = 3e-2
GPU_BACKENDS = ["torch", "triton", "flashinfer"]
GPU_HEAD_DIM = 128  # a head size every FlashInfer build ships kernels for
# FlashInfer runs only on CUDA: there, in bf16 at a head size it ships.
FLASHINFER_ON_GPU = pytest.param("flashinfer", marks=pytest.mark.gpu)


def pools_for(name: str) -> Pools:
    """CPU float32 pools, or CUDA bf16 ones for FlashInfer."""
    return make_pools("cuda", torch.bfloat16, GPU_HEAD_DIM) if name == "flashinfer" else make_pools()


def tolerance_for(name: str) -> float:
    return ATOL_BF16 if name == "flashinfer" else ATOL_F32


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_gpu_eager_matches_reference(name, case):
    rng = random.Random(f"gpu-eager-{name}-{case.id}")
    pools = make_pools("cuda", torch.bfloat16, GPU_HEAD_DIM)
    backend, ref = make_backend(name, pools), ReferenceBackend(pools.req, pools.kv)
    bs = 0 if case.mode.is_idle() else rng.randint(1, MAX_BS)
    batch = draw_batch(pools, case, bs, rng)
    qkv = random_qkv(batch.num_tokens, pools, torch.Generator().manual_seed(rng.randrange(2**31)))
    assert_close(eager(backend, batch, qkv), eager(ref, batch, qkv), ATOL_BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in GRAPH_CASES if not c.mode.is_idle()], ids=lambda c: c.id)
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_cuda_graph_replays_fresh_batches_like_reference(name, case):
    """Capture ``torch.cuda.CUDAGraph`` around the op once, replay three fresh
    batches through static inputs; the replay hook must not sync (torch, triton)."""
    rng = random.Random(f"cuda-graph-{name}-{case.id}")
    pools = make_pools("cuda", torch.bfloat16, GPU_HEAD_DIM)
    backend, ref = make_backend(name, pools), ReferenceBackend(pools.req, pools.kv)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    padded_bs, fill = 4, backend.get_cuda_graph_seq_len_fill_value()
    init_graph_state(backend, case.mode)
    first = draw_batch(pools, case, rng.randint(1, padded_bs), rng)
    static = pad_for_graph(first, padded_bs, fill)  # its tensors are the graph's inputs
    static_qkv = pad_qkv(random_qkv(first.num_tokens, pools, gen), first, static, pools, gen)
    capture(backend, static)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: JIT compiles, lazy allocations
        attend(backend, static, static_qkv)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = attend(backend, static, static_qkv)

    for _ in range(3):
        batch = draw_batch(pools, case, rng.randint(1, padded_bs), rng)
        qkv = random_qkv(batch.num_tokens, pools, gen)
        padded = pad_for_graph(batch, padded_bs, fill)
        static.out_cache_loc.copy_(padded.out_cache_loc)
        for dst, src in zip(static_qkv, pad_qkv(qkv, batch, padded, pools, gen)):
            for d, s in zip(dst, src):
                d.copy_(s)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if name != "flashinfer" else "default")
        try:  # flashinfer's plan() reads the indptrs on the host by design
            replay(backend, padded)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph.replay()
        want = eager(ref, batch, qkv)
        assert_close([o[: batch.num_tokens] for o in outs], want, ATOL_BF16)
