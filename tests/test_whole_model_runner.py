"""``CudaGraphRunner``: whole-model decode graphs fed by the registry, with
attention metadata through the backend's capture/replay hooks.

On a CPU the graph itself is a pass-through, so these tests check everything
around it — the registry fill (padding included), the hooks, the static batch,
fallbacks — against the eager step on fresh random ragged batches. The GPU
tests repeat them with real CUDA graphs in bf16, for every graph backend.
"""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch

from sgl_piecewise import ForwardMode
from sgl_piecewise.backends import ReferenceBackend, create_backend
from sgl_piecewise.backends.metadata import SEQ_LENS_SUM_UNKNOWN
from sgl_piecewise.backends.torch_graph import TorchGraphBackend
from sgl_piecewise.compile import CompiledModel, CompileOptions, counters
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.engine.testing import random_batch, release_batch
from sgl_piecewise.errors import InvalidInputError, UnsupportedModeError
from sgl_piecewise.models import ModelConfig, build_random_model
from sgl_piecewise.runners.whole_model import CudaGraphRunner

VOCAB = 101
CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=128,
)
CAPTURE_BS = (1, 2, 4)
CPU_BACKENDS = ["torch", "triton"]
# Off CUDA the triton decode grid's split axis is max_kv_splits whole (no SM
# count sizes it), one interpreted program per split and (request, kv head).
# A context here holds at most 96 keys and a split 64 (the kernel's
# tokens_per_split), so no request takes more than 2 splits: 2 keeps every
# request's split count (the merge of 2 splits, and the idle second split of
# a 1-split request) at a 32nd of the default 64's programs.
CPU_TRITON_OPTIONS = dict(max_kv_splits=2)


def _backend(name: str, device="cpu"):
    if name == "triton":
        pytest.importorskip("triton")
    options = CPU_TRITON_OPTIONS if name == "triton" and torch.device(device).type == "cpu" else {}
    return partial(create_backend, name, num_q_heads=CONFIG.num_attention_heads, **options)


def _runners(name: str, device="cpu", dtype=torch.float32, config=CONFIG, max_reqs=12):
    """An eager runner and a graph runner over the same model (separate pools)."""
    model = build_random_model(config, dtype, device, seed=5, std=0.2)
    kwargs = dict(max_reqs=max_reqs, max_context_len=96, backend=_backend(name, device))
    eager, graphs = ModelRunner(model, **kwargs), ModelRunner(model, **kwargs)
    return eager, graphs, CudaGraphRunner(graphs, CAPTURE_BS)


def _decode_batch(runner: ModelRunner, prefix_lens, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return random_batch(ForwardMode.DECODE, runner.req_to_token_pool, runner.kv_pool, prefix_lens,
                        [1] * len(prefix_lens), vocab_size=VOCAB, generator=gen)  # fmt: skip


def _same_step(eager: ModelRunner, graphs: ModelRunner, prefix_lens, seed: int):
    """Logits of one random decode step, eagerly and through the graph runner;
    both pools hold the same random prefixes (same generator seed)."""
    a = _decode_batch(eager, prefix_lens, seed)
    b = _decode_batch(graphs, prefix_lens, seed)
    return eager.forward_step(a), graphs.forward_step(b), (a, b)


def _free(runner: ModelRunner, batch) -> None:
    release_batch(runner.req_to_token_pool, runner.kv_pool, batch)


def _check_fresh_batches(eager, graphs, rng: random.Random, sizes, tol: float) -> None:
    """One fresh random decode step per size (skewed prefixes: empty, one
    token, long), through both runners; every step must replay."""
    counters.reset()
    for bs in sizes:
        prefix = [rng.choice([0, 1, rng.randint(2, 90)]) for _ in range(bs)]
        want, got, batches = _same_step(eager, graphs, prefix, seed=rng.randrange(2**31))
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        for r, b in zip((eager, graphs), batches):
            _free(r, b)
    assert counters.replays == len(sizes) and not counters.eager_fallbacks


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_replay_equals_eager_on_fresh_ragged_batches_of_every_size(name):
    eager, graphs, runner = _runners(name)
    graphs.use_graphs(runner, progress=False)
    # Every captured size, and 3 padded to 4 (the graph of 4 replayed twice,
    # for a full and a padded batch); sizes go down and up.
    _check_fresh_batches(eager, graphs, random.Random(f"decode-graphs-{name}"), (4, 1, 3, 2), 1e-4)


def test_generate_with_decode_graphs_gives_the_eager_tokens():
    eager, graphs, runner = _runners("torch")
    graphs.use_graphs(runner, progress=False)
    prompts = [[3, 14, 15, 92], [6], [53, 58, 9]]  # 3 requests: padded to 4
    counters.reset()
    free = graphs.kv_pool.available
    assert graphs.generate(prompts, 8) == eager.generate(prompts, 8)
    assert counters.replays == 7  # every decode step; the prefill ran eagerly
    assert graphs.kv_pool.available == free  # every slot freed


def test_a_compiled_forward_replays_like_eager():
    """The graphs may record the sgl_piecewise-compiled model (Inductor
    pieces, attention between them): one trace serves every batch size."""
    torch._dynamo.reset()  # other tests' cache entries for the same code must not count here
    eager, graphs, _ = _runners("torch")
    compiled = CompiledModel(graphs.model, CompileOptions())
    counters.reset()
    graphs.use_graphs(CudaGraphRunner(graphs, CAPTURE_BS, forward=compiled), progress=False)
    assert counters.graphs_split == 1  # compiled at capture, on a CPU too: one trace for sizes 4, 2 and 1
    _check_fresh_batches(eager, graphs, random.Random("compiled-forward"), (2, 1, 4), 1e-4)
    assert counters.graphs_split == 0  # no step compiles or recompiles


def test_a_forward_compiled_whole_replays_like_eager():
    """split_graph=False: one compiled graph with attention inside it, no
    split, recorded whole by the runner."""
    torch._dynamo.reset()
    eager, graphs, _ = _runners("torch")
    compiled = CompiledModel(graphs.model, CompileOptions(split_graph=False))
    counters.reset()
    graphs.use_graphs(CudaGraphRunner(graphs, CAPTURE_BS, forward=compiled), progress=False)
    # One graph, compiled at capture as one piece: no split, nothing shared.
    assert (counters.graphs_split, counters.pieces_compiled) == (0, 1)
    _check_fresh_batches(eager, graphs, random.Random("compiled-whole"), (2, 1, 4), 1e-4)
    assert counters.pieces_compiled == 0


def test_whole_graph_compilation_refuses_the_backends_own_graphs():
    with pytest.raises(InvalidInputError, match="split_graph=False: expected cudagraphs=False"):
        CompileOptions(split_graph=False, cudagraphs=True)


def test_batches_above_the_largest_size_run_eagerly_and_are_counted():
    eager, graphs, runner = _runners("torch")
    graphs.use_graphs(runner, progress=False)
    counters.reset()
    want, got, _ = _same_step(eager, graphs, [5, 9, 1, 30, 2], seed=3)  # 5 > 4
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert counters.replays == 0
    assert counters.eager_fallbacks == {"decode graphs: batch of 5 above the largest captured 4": 1}


def test_other_modes_run_eagerly_without_counting_a_fallback():
    _, graphs, runner = _runners("torch")
    graphs.use_graphs(runner, progress=False)
    counters.reset()
    gen = torch.Generator().manual_seed(0)
    batch = random_batch(ForwardMode.EXTEND, graphs.req_to_token_pool, graphs.kv_pool, [4, 0], [3, 5],
                         vocab_size=VOCAB, generator=gen)  # fmt: skip
    assert graphs.forward_step(batch).shape == (2, VOCAB)
    assert counters.replays == 0 and not counters.eager_fallbacks


def test_a_runner_not_handed_to_use_graphs_serves_no_step():
    """Built and captured, but never handed to ``use_graphs``: steps run eagerly."""
    eager, graphs, runner = _runners("torch")
    runner.capture(progress=False)
    counters.reset()
    want, got, _ = _same_step(eager, graphs, [4, 7], seed=1)
    torch.testing.assert_close(got, want)
    assert graphs.step_graphs is None and graphs.step_stats[-1].path == "eager"
    assert counters.step_paths == {("eager", "graphs='none'"): 2}  # the eager twin's step and this one
    assert counters.replays == 0 and not counters.eager_fallbacks


def test_capture_fills_its_dummies_through_the_registry():
    """A capture's batch is all padding: fill-value lengths, row 0, the dummy slot."""
    _, graphs, runner = _runners("torch")
    runner.capture(progress=False)
    static = runner._static[(ForwardMode.DECODE, 4)]
    assert static.seq_lens.tolist() == [1] * 4 and static.req_pool_indices.tolist() == [0] * 4
    assert static.out_cache_loc.tolist() == [0] * 4 and static.positions.tolist() == [0] * 4
    assert int(static.num_token_non_padded) == 0


def _hook_calls(backend, monkeypatch) -> list:
    """Every replay hook call's ``(bs, seq_lens_sum, seq_lens_cpu copy or None)``."""
    calls, original = [], type(backend).init_forward_metadata_replay_cuda_graph

    def spy(self, bs, rows, seq_lens, seq_lens_sum, enc, mode, spec, seq_lens_cpu=None):
        calls.append((bs, seq_lens_sum, None if seq_lens_cpu is None else seq_lens_cpu.tolist()))
        return original(self, bs, rows, seq_lens, seq_lens_sum, enc, mode, spec, seq_lens_cpu)

    monkeypatch.setattr(type(backend), "init_forward_metadata_replay_cuda_graph", spy)
    return calls


def test_a_backend_whose_replay_reads_no_host_lengths_gets_none_and_no_host_copy_is_kept(monkeypatch):
    eager, graphs, runner = _runners("torch")
    assert graphs.backend.replay_reads_host_lengths is False
    assert all("seq_lens_cpu" not in registry for registry in runner.registries.values())
    graphs.use_graphs(runner, progress=False)
    assert runner._static[(ForwardMode.DECODE, 4)].seq_lens_cpu is None
    calls = _hook_calls(graphs.backend, monkeypatch)
    _check_fresh_batches(eager, graphs, random.Random("no-host-lengths"), (3,), 1e-4)
    assert calls == [(4, SEQ_LENS_SUM_UNKNOWN, None)]


def test_a_backend_whose_replay_reads_host_lengths_gets_them_padded(monkeypatch):
    """A backend written for SGLang's hook may read ``seq_lens_cpu`` and
    ``seq_lens_sum``: the runner keeps the host copy for it, padded like the
    device lengths, and passes the padded sum."""
    monkeypatch.setattr(TorchGraphBackend, "replay_reads_host_lengths", True)
    eager, graphs, runner = _runners("torch")
    assert all("seq_lens_cpu" in registry for registry in runner.registries.values())
    graphs.use_graphs(runner, progress=False)
    calls = _hook_calls(graphs.backend, monkeypatch)
    batch = _decode_batch(graphs, [4, 9, 30], seed=3)
    graphs.forward_step(batch)
    fill = graphs.backend.get_cuda_graph_seq_len_fill_value()
    lengths = batch.seq_lens_cpu.tolist() + [fill]  # padded from 3 to 4 requests
    assert calls == [(4, sum(lengths), lengths)]
    _free(graphs, batch)


def test_bad_configurations_are_refused_with_the_reason():
    model = build_random_model(CONFIG, seed=0)
    with pytest.raises(UnsupportedModeError, match="supports_cuda_graph=True"):
        CudaGraphRunner(ModelRunner(model, max_reqs=4, backend=ReferenceBackend))
    runner = ModelRunner(model, max_reqs=4, backend=_backend("torch"))
    with pytest.raises(InvalidInputError, match=r"capture_bs: expected sizes in \[1, 4\]"):
        CudaGraphRunner(runner, (1, 8))
    with pytest.raises(InvalidInputError, match="capture_bs"):
        CudaGraphRunner(runner, (0, 2))
    assert CudaGraphRunner(runner).capture_bs == [1, 2, 4]  # the default schedule, capped


# ---- GPU: real CUDA graphs, bf16 -------------------------------------------
GPU_CONFIG = ModelConfig(**{**CONFIG.__dict__, "head_dim": 64, "hidden_size": 256})


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch", "triton", "flashinfer"])
def test_gpu_decode_graphs_equal_eager_on_fresh_ragged_batches(name):
    if name == "flashinfer":
        pytest.importorskip("flashinfer")
    eager, graphs, runner = _runners(name, "cuda", torch.bfloat16, GPU_CONFIG, max_reqs=24)
    graphs.use_graphs(runner, progress=False)
    assert len(runner._graphs) == len(CAPTURE_BS)
    # Same kernels, same inputs; batch-size-dependent launch choices (split
    # counts of the padded batch) may reorder sums: bf16 tolerance on logits.
    _check_fresh_batches(eager, graphs, random.Random(f"gpu-decode-graphs-{name}"), (4, 1, 3, 2, 4, 1), 5e-2)


def _fills_of(backend, monkeypatch) -> list:
    """The binding keys ``backend`` fills (device work launched from the hook) from now on."""
    keys, original = [], type(backend)._fill_bound

    def spy(self, key, *args):
        if self is backend:
            keys.append(key)
        return original(self, key, *args)

    monkeypatch.setattr(type(backend), "_fill_bound", spy)
    return keys


def test_without_cuda_no_graph_holds_the_fill_and_the_hook_fills(monkeypatch):
    eager, graphs, runner = _runners("torch")
    graphs.use_graphs(runner, progress=False)
    assert not graphs.backend._caller_graph_fills
    fills = _fills_of(graphs.backend, monkeypatch)
    _check_fresh_batches(eager, graphs, random.Random("cpu-fill"), (2, 4), 1e-4)
    assert fills == [("graph", ForwardMode.DECODE, 2), ("graph", ForwardMode.DECODE, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_gpu_decode_graphs_hold_the_metadata_fill(name, monkeypatch):
    """A replay launches no metadata fill: each graph recorded it with the
    model (``fill_in_graph``), reading the registry's buffers. Fresh ragged
    batches still equal eager, and the replay hook given tensors other than
    the graph's inputs fills as before."""
    eager, graphs, runner = _runners(name, "cuda", torch.bfloat16, GPU_CONFIG, max_reqs=24)
    graphs.use_graphs(runner, progress=False)
    backend = graphs.backend
    assert set(backend._caller_graph_fills) == {("graph", ForwardMode.DECODE, bs) for bs in CAPTURE_BS}
    fills = _fills_of(backend, monkeypatch)
    _check_fresh_batches(eager, graphs, random.Random(f"gpu-fill-{name}"), (4, 1, 3, 2, 4), 5e-2)
    assert fills == []
    static = runner._static[(ForwardMode.DECODE, 4)]
    lens = torch.tensor([5, 1, 9, 2], dtype=torch.int32, device="cuda")
    backend.init_forward_metadata_replay_cuda_graph(
        4, static.req_pool_indices.clone(), lens, 17, None, ForwardMode.DECODE, None, lens.cpu()
    )
    assert fills == [("graph", ForwardMode.DECODE, 4)]
    assert backend.forward_metadata.kv_lens.tolist() == [5, 1, 9, 2]


@pytest.mark.gpu
def test_gpu_a_second_runner_over_the_backend_leaves_the_first_holding_its_fill(monkeypatch):
    """Two whole-model runners over one backend capture the same sizes, each
    over its own inputs: the second's capture must not take the fill out of
    the first's graphs (the first's replays would fill again before each
    graph). Both replay fresh batches as eager does, with no fill outside
    their graphs."""
    eager, graphs, first = _runners("triton", "cuda", torch.bfloat16, GPU_CONFIG, max_reqs=24)
    graphs.use_graphs(first, progress=False)
    second = CudaGraphRunner(graphs, CAPTURE_BS)
    second.capture(progress=False)
    fills = _fills_of(graphs.backend, monkeypatch)
    for runner in (first, second):
        graphs.use_graphs(runner)
        _check_fresh_batches(eager, graphs, random.Random("two-runners"), (4, 1, 3), 5e-2)
    assert fills == []


def _pools_of_blocks_freed_by_clearing_cublas_workspaces() -> list:
    """Do what torch.compile's reduce-overhead does before it records (free
    every cuBLAS workspace); return the memory pool of each block it freed.

    A workspace in the default pool (0, 0) was allocated outside every graph
    pool; if a graph kept it as scratch, the memory now belongs to whoever
    allocates next (an illegal address on an H200, before the fix).
    """

    def active() -> dict:
        return {b["address"]: tuple(seg["segment_pool_id"]) for seg in torch.cuda.memory_snapshot()
                for b in seg["blocks"] if b["state"] == "active_allocated"}  # fmt: skip

    torch.cuda.synchronize()
    before = active()
    torch._C._cuda_clearCublasWorkspaces()
    after = active()
    return [pool for address, pool in before.items() if address not in after]


@pytest.mark.gpu
def test_gpu_decode_graphs_keep_their_cublas_workspace_in_their_pool():
    eager, graphs, runner = _runners("torch", "cuda", torch.bfloat16, GPU_CONFIG, max_reqs=24)
    graphs.use_graphs(runner, progress=False)  # no eager matmul has run: every workspace is a capture's
    freed = _pools_of_blocks_freed_by_clearing_cublas_workspaces()
    assert freed, "expected the captures' cuBLAS workspace, got no block freed"
    assert all(pool != (0, 0) for pool in freed), freed
    # And the graphs still replay correctly with it released.
    _check_fresh_batches(eager, graphs, random.Random("gpu-cublas"), (4, 2, 1), 5e-2)


# ---- two runners on one ModelRunner ------------------------------------------
def _metadata_addresses(backend) -> dict:
    meta = backend.forward_metadata
    return {name: t.data_ptr() for name, t in vars(meta).items() if isinstance(t, torch.Tensor)}


def _second_runner_then_first_again(name, device="cpu", dtype=torch.float32, config=CONFIG):
    """Capture runner A, note where bs 2 reads its metadata, then build and
    capture runner B (larger sizes, same ModelRunner) and give A the steps
    back. Returns (eager, graphs, A, B, addresses before, addresses after)."""
    eager, graphs, first = _runners(name, device, dtype, config, max_reqs=24)
    graphs.use_graphs(first, progress=False)
    _check_fresh_batches(eager, graphs, random.Random("first"), (2,), 1e-4 if dtype == torch.float32 else 5e-2)
    before = _metadata_addresses(graphs.backend)
    second = CudaGraphRunner(graphs, (1, 2, 8), forward=graphs.model)  # a larger size: more static buffers
    second.capture(progress=False)
    graphs.use_graphs(first)
    _check_fresh_batches(eager, graphs, random.Random("first-again"), (2,), 1e-4 if dtype == torch.float32 else 5e-2)
    return eager, graphs, first, second, before, _metadata_addresses(graphs.backend)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_a_second_runner_on_the_same_model_runner_moves_no_buffer_the_first_one_reads(name):
    """A captured graph reads its metadata at fixed addresses; a later
    capture that allocated the backend's static buffers anew left the first
    runner's graphs reading the old ones (on an H200: hidden states off by
    4.6 with no error)."""
    eager, graphs, first, second, before, after = _second_runner_then_first_again(name)
    assert after == before
    graphs.use_graphs(second)
    _check_fresh_batches(eager, graphs, random.Random("second"), (8, 5, 1), 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch", "triton", "flashinfer"])
def test_gpu_two_runners_on_one_model_runner_both_replay_like_eager(name):
    if name == "flashinfer":
        pytest.importorskip("flashinfer")
    eager, graphs, first, second, before, after = _second_runner_then_first_again(
        name, "cuda", torch.bfloat16, GPU_CONFIG
    )
    assert after == before
    _check_fresh_batches(eager, graphs, random.Random("gpu-first"), (4, 1, 3), 5e-2)
    graphs.use_graphs(second)
    _check_fresh_batches(eager, graphs, random.Random("gpu-second"), (8, 5, 2), 5e-2)


@pytest.mark.gpu
def test_gpu_a_new_runner_captures_after_every_earlier_graph_is_gone():
    """The shared capture core's pool outlives the graphs captured into it:
    the allocator refuses a capture into a pool whose graphs are all gone."""
    import gc

    for seed in ("first", "second"):
        eager, graphs, runner = _runners("torch", "cuda", torch.bfloat16, GPU_CONFIG, max_reqs=24)
        graphs.use_graphs(runner, progress=False)
        _check_fresh_batches(eager, graphs, random.Random(seed), (2,), 5e-2)
        del eager, graphs, runner
        gc.collect()
