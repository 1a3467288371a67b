"""What the benchmark scripts share: model shapes, timers, the card's
ceilings, the step floor, and batches laid out in a runner's pools.

Timing: on CUDA, CUDA events around each call (median); on the CPU (smoke
runs of the scripts' logic), wall time. Nothing here is a test.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

import sgl_piecewise as sp
from sgl_piecewise.engine.testing import place_requests, release_batch

# Hugging Face config.json dicts of the shapes the benchmarks run.
SHAPES: Dict[str, dict] = {
    # Qwen2.5-0.5B: tied embeddings, QKV bias.
    "0.5b": dict(
        architectures=["Qwen2ForCausalLM"],
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),  # fmt: skip
    # Llama-3.2-1B.
    "1b": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),  # fmt: skip
    # Llama-3-8B: 16 GB of bf16 weights; 8 KV heads (tensor parallelism up to 8).
    "8b": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),  # fmt: skip
    # SmolLM2-135M: the main job's real model (tied embeddings).
    "135m": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),  # fmt: skip
    # A few-layer model for smoke runs of the scripts on the CPU.
    "tiny": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=512,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
    ),  # fmt: skip
}
QWEN_05B = SHAPES["0.5b"]


def write_json(folder: str, name: str, result: object) -> str:
    """Write ``result`` to ``folder/name`` as indented JSON (the folder made
    if missing); the file's path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def step_times_ms(
    fn: Callable[[], object], iters: int, cuda: Optional[bool] = None, host: Optional[List[float]] = None
) -> List[float]:
    """``iters`` timings of ``fn`` in ms: CUDA events on a GPU (``cuda``; by
    default wherever CUDA is available), wall time otherwise. On a GPU,
    ``host`` gets each call's host time: the wall time until ``fn`` returns,
    its launches queued (the device has finished the step before)."""
    times = []
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            start = time.perf_counter()
            fn()
            if host is not None:
                host.append(1e3 * (time.perf_counter() - start))
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
    return times


# A step right after the card idled runs slower (its clocks are down), and
# about 10 ms of work brings it back: every timing follows at least this much
# wall time of the timed function's own work, each call synchronised as the
# timed ones are (steps queued back to back without synchronising would time
# the burst instead).
STEADY_CLOCKS_S = 0.025


def keep_busy(fn: Callable[[], object], seconds: float = STEADY_CLOCKS_S, sync_each: bool = True) -> None:
    """On a GPU, call ``fn`` until ``seconds`` of wall time have passed (at
    least once), so the card's clocks are up when the timing starts; then
    synchronise. Off a GPU, nothing.

    ``sync_each=True``: each call is synchronised, as the timed steps are.
    ``sync_each=False``: the calls are queued back to back, so a step whose
    host part is short queues more than ``seconds`` of device work (a
    whole-model decode step with 145-330 µs of host time: 75-170 steps)."""
    if not torch.cuda.is_available():
        return
    end = time.perf_counter() + seconds
    while True:
        fn()
        if sync_each:
            torch.cuda.synchronize()
        if time.perf_counter() >= end:
            break
    torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], warmup: int = 5, iters: int = 30) -> float:
    """Median time of ``fn`` in ms: CUDA events on a GPU, wall time otherwise;
    after ``warmup`` calls and, on a GPU, :func:`keep_busy`."""
    for _ in range(warmup):
        fn()
    keep_busy(fn)
    return statistics.median(step_times_ms(fn, iters))


def time_paths(
    paths: Dict[str, Callable[[], Callable]],
    rounds: int = 6,
    iters: int = 5,
    warm_up: Callable = keep_busy,
    samples: Optional[Dict[str, dict]] = None,
) -> dict:
    """Median ms of each path (a factory of its step), its max |logit
    difference| to the first path, and on a GPU its median and least host
    time (``<path>_host_ms``, ``<path>_host_min_ms``, :func:`step_times_ms`;
    the host's other load only adds to a call's, so the least is the steadier
    figure between processes); a failing path records its error. ``samples``
    gets every timed step of each path: ``{"step": [ms], "host": [ms]}``.

    The paths' steps are timed in ``rounds`` interleaved rounds of ``iters``
    each, not one path after the other: the host's load drifts over seconds,
    and interleaved, a drift falls on every path alike, so their ratios hold.
    In each round a path's timed steps follow ``warm_up`` (:func:`keep_busy`)
    of its own steps: after a host-bound path (eager) the card has idled and
    lowered its clocks, and the next path's first steps would run slower.
    """
    result, runs, ref = {}, {}, None

    def failed(name: str, e: Exception) -> None:
        result[name] = None
        result[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"[{name}] failed: {result[name + '_error']}", file=sys.stderr)

    with torch.no_grad():
        for name, make in paths.items():
            try:  # one path failing must not hide the rest
                run = make()
                logits = run()
                for _ in range(5):
                    run()
            except Exception as e:
                failed(name, e)
                continue
            result[name] = None  # filled below; keeps the paths' order
            result[name + "_maxdiff"] = 0.0 if ref is None else float((logits - ref).abs().max())
            ref = logits if ref is None else ref
            runs[name] = run
        steps: Dict[str, List[float]] = {name: [] for name in runs}
        host: Dict[str, List[float]] = {name: [] for name in runs}
        for _ in range(rounds):
            for name in list(runs):
                try:
                    warm_up(runs[name])
                    steps[name] += step_times_ms(runs[name], iters, host=host[name])
                except Exception as e:
                    failed(name, e)
                    del runs[name], steps[name]
        for name, times in steps.items():
            result[name] = statistics.median(times)
            if host[name]:
                result[name + "_host_ms"] = statistics.median(host[name])
                result[name + "_host_min_ms"] = min(host[name])
            if samples is not None:
                samples[name] = {"step": times, "host": host[name]}
    return result


def copy_rate() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x), 3, 20)
    return 2 * x.numel() / (ms / 1e3)


def matmul_rate() -> float:
    """bf16 FLOP/s of an 8192 x 8192 x 8192 matmul on random data."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    ms = median_ms(lambda: a @ b, 3, 10)
    return 2 * 8192**3 / (ms / 1e3)


def weight_bytes(model) -> tuple[int, int]:
    """(bytes read per step: weights minus the embedding table, plus the LM
    head even when tied; non-embedding parameter count)."""
    emb = model.model.embed_tokens.weight if hasattr(model, "model") else None
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb_bytes = emb.numel() * emb.element_size() if emb is not None else 0
    tied = model.config.tie_word_embeddings
    read = total - emb_bytes + (emb_bytes if tied else 0)
    return read, (total - emb_bytes) // 2


def kv_bytes_per_token(config) -> int:
    """K and V of one token over every layer, bf16."""
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2


def decode_floor_ms(read_bytes: int, kv_per_token: int, bs: int, context: int, rate: float) -> float:
    """Weights read once plus every request's K/V, at the copy rate."""
    return 1e3 * (read_bytes + bs * context * kv_per_token) / rate


def extend_floor_ms(read_bytes: int, nonemb_params: int, tokens: int, rate: float, flops: float) -> float:
    """The larger of the weight read and the matmul work."""
    return 1e3 * max(read_bytes / rate, 2 * nonemb_params * tokens / flops)


def make_batch(runner, mode, prefix, extend):
    """A batch of random token ids whose requests are laid out in the runner's pools."""
    rows, loc = place_requests(runner.req_to_token_pool, runner.kv_pool, prefix, extend, fill_prefix=False)
    ids = torch.randint(0, runner.config.vocab_size, (sum(extend),), device=runner.device)
    return sp.ForwardBatch.build(mode, ids, rows, prefix, extend, loc)


def free_batch(runner, batch) -> None:
    release_batch(runner.req_to_token_pool, runner.kv_pool, batch)


def step_fn(runner, fn, batch, keep_metadata=False):
    """One whole step through ``fn``, as ``ModelRunner.run_model`` runs it,
    then the LM head. The batch is not validated (``check_batch``) here:
    the engine, ``ModelRunner.forward_step``, validates it once per step
    before it picks a path, and a whole-model replay (``graph_step_fn``)
    does not validate it, so no timed path pays for it.

    ``keep_metadata``: hold every step's attention metadata until the end.
    reduce-overhead records attention with the metadata tensors of its
    recording call inside its graph and replays those addresses; freed,
    their memory could be reused and the replayed kernels would read other
    tensors as page tables. Kept alive, they hold the same batch's values,
    so the timing stays honest."""
    kept = []

    def run():
        runner.backend.init_forward_metadata(batch)
        if keep_metadata:
            kept.append(runner.backend.forward_metadata)
        with sp.forward_context(batch, runner.backend, check=False):
            h = fn(batch.input_ids, batch.positions)
        return runner.last_token_logits(h, batch)

    return run


def graph_step_fn(runner, decode_graphs, batch):
    """A step through the whole-model graphs (metadata replay included)."""

    def run():
        return runner.last_token_logits(decode_graphs.try_replay(batch), batch)

    return run
