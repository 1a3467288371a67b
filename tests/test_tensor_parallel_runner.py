"""Tensor parallelism through the engine: two ranks over gloo generate one
rank's greedy tokens under every graph policy, and capture in lockstep.

Each rank holds half the heads, half the MLP and half the vocabulary of the
embedded model (``models/parallel.py``); the row-parallel projections and
the embedding all-reduce, the LM head gathers, all through the custom ops
of ``distributed/`` that the compiled pieces and the graphs hold inside.
"""

from __future__ import annotations

import random

import pytest
import torch

from sgl_piecewise import ForwardMode
from sgl_piecewise.compile import precompiled
from sgl_piecewise.compile.artifacts import artifact_key
from sgl_piecewise.compile.options import CompileOptions
from sgl_piecewise.distributed import RankFailedError, fused_norm, init_tensor_parallel, launch, tensor_parallel
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.engine.testing import prefill_logits
from sgl_piecewise.graphs.input_registries import compute_local_num_token_non_padded
from sgl_piecewise.models import build_random_model, default_config
from sgl_piecewise.runners.dispatch import POLICIES, token_split

# Four prompts of at most 12 tokens: the prefill (at most 48 tokens) and every
# decode step (4 requests) fit a graph of each policy.
CAPTURE = dict(capture_bs=(4,), capture_sizes=(4, 16, 48), piece_compiler="eager")
GRAPH_PATHS = {"none": set(), "full": {"whole_model"}, "piecewise": {"piecewise"}, "breakable": {"breakable"},
               "auto": {"whole_model", "piecewise"}}  # fmt: skip


def _prompts(n: int = 4, longest: int = 12, vocab: int = 4096) -> list:
    rng = random.Random(1)
    return [[rng.randrange(vocab) for _ in range(rng.randint(2, longest))] for _ in range(n)]


def _generate_every_policy(
    prompts: list, new_tokens: int, piece_compiler: str = "eager", policies: tuple = POLICIES
) -> dict:
    """Greedy tokens of ``prompts`` under each policy, on this process's rank."""
    model = build_random_model(default_config(), torch.float32, "cpu", seed=0)
    tokens, paths = {}, {}
    for policy in policies:
        runner = ModelRunner(model, max_reqs=8, max_context_len=96, backend="torch", graphs=policy)
        runner.capture_graphs(progress=False, **{**CAPTURE, "piece_compiler": piece_compiler})
        tokens[policy] = runner.generate(prompts, new_tokens, progress=False)
        paths[policy] = {s.path for s in runner.step_stats}
    prefill = prefill_logits(model, prompts[0])  # bench's reference for a differing token's logit gap
    return {"rank": tensor_parallel().rank, "tokens": tokens, "paths": paths, "keys": _saved_compile_keys(model),
            "prefill": prefill}  # fmt: skip


def _saved_compile_keys(model) -> tuple:
    """The keys a saved compile of ``model`` is stored under on this rank."""
    args = (torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    return precompiled.model_key(model, args, CompileOptions()), artifact_key("graph", CompileOptions(), args[0].device)


def _with_and_without_sequence_parallelism(*args) -> dict:
    """``_generate_every_policy(*args)`` with the residual stream whole, then
    split across the ranks by tokens (a model built afresh each time): one
    launch, its processes' start-up paid once."""
    out = {}
    for mode in ("tp", "tp+sp"):
        init_tensor_parallel(device="cpu", sequence_parallel=mode == "tp+sp")  # the launched group, re-flagged
        out[mode] = _generate_every_policy(*args)
    return out


def test_two_ranks_generate_one_ranks_tokens_under_every_policy_with_and_without_sequence_parallelism():
    prompts = _prompts()
    # One rank, eager: the single-rank tests show every policy gives these tokens.
    model = build_random_model(default_config(), torch.float32, "cpu", seed=0)
    eager = ModelRunner(model, max_reqs=8, max_context_len=96, backend="torch").generate(prompts, 10, progress=False)
    prefill = prefill_logits(model, prompts[0])
    ranks = launch(_with_and_without_sequence_parallelism, 2, prompts, 10, timeout_s=900)
    for r, modes in enumerate(ranks):
        for mode, result in modes.items():
            assert result["rank"] == r
            torch.testing.assert_close(result["prefill"], prefill, atol=1e-5, rtol=1e-5)
            for policy in POLICIES:
                assert result["tokens"][policy] == eager, f"rank {r}, {mode}, graphs={policy}"
                assert GRAPH_PATHS[policy] <= result["paths"][policy], (
                    f"rank {r}, {mode}, graphs={policy}: {result['paths']}"
                )
    # One saved compile per rank, group size and split of the stream: no rank
    # loads another's, nor a compile without sequence parallelism one with it.
    # (The artifacts of a graph are keyed by its ops as well: one folder per rank.)
    keys = [_saved_compile_keys(model)] + [result["keys"] for modes in ranks for result in modes.values()]
    assert len({model_key for model_key, _ in keys}) == 5, keys
    assert len({artifacts for _, artifacts in keys}) == 3, keys


def test_four_ranks_two_sharing_each_kv_head_generate_one_ranks_tokens_with_and_without_sequence_parallelism():
    # The embedded model's 4 query and 2 KV heads over 4 ranks: one query head
    # a rank, each KV head held by the two ranks whose query heads read it.
    prompts = _prompts()
    model = build_random_model(default_config(), torch.float32, "cpu", seed=0)
    eager = ModelRunner(model, max_reqs=8, max_context_len=96, backend="torch").generate(prompts, 10, progress=False)
    ranks = launch(_with_and_without_sequence_parallelism, 4, prompts, 10, "eager", ("auto",), timeout_s=900)
    for r, modes in enumerate(ranks):
        for mode, result in modes.items():
            assert result["tokens"]["auto"] == eager, f"rank {r}, {mode}"
            assert GRAPH_PATHS["auto"] <= result["paths"]["auto"], f"rank {r}, {mode}: {result['paths']}"


# Sequence parallelism, padding that crosses from one rank's share of the
# rows into the other's: prompts of 3 and 2 tokens. Their prefill (5 tokens)
# replays the piecewise or breakable graph of 8, whose rows 0-3 are rank 0's
# (all real) and 4-7 rank 1's (one real, three padding); the odd captured
# sizes make the model pad inside those graphs too. Each decode step (2
# requests) replays the whole-model graph of 4 requests: rank 0's rows real,
# rank 1's padding, and the count of real rows its registry writes is each
# rank's own.
CROSSING_PROMPTS = [[17, 4011, 250], [99, 7]]
CROSSING_CAPTURE = dict(capture_bs=(4,), capture_sizes=(3, 8, 13))


def _crossing_tokens(piece_compiler: str, device: str = "cpu", backend: str = "torch") -> dict:
    model = build_random_model(default_config(), torch.float32, device, seed=0)
    out = {}
    for policy in ("full", "piecewise", "breakable"):
        runner = ModelRunner(model, max_reqs=4, max_context_len=32, backend=backend, graphs=policy)
        runner.capture_graphs(progress=False, piece_compiler=piece_compiler, **CROSSING_CAPTURE)
        tokens = runner.generate(CROSSING_PROMPTS, 6, progress=False)
        out[policy] = (tokens, sorted({s.path for s in runner.step_stats}))
        if policy == "full":  # what the last decode replay (2 requests in the graph of 4) read
            registry = runner.step_graphs.registries[ForwardMode.DECODE]
            out["num_token_non_padded"] = int(registry.get_slot("num_token_non_padded").slice_for(4, 4))
    return out


def _check_crossing(device: str, backend: str) -> None:
    """Both ranks' tokens in every graph path are one rank's eager tokens, and
    each rank's registry held its own count of real rows."""
    # The premise: rank 1's share of the prefill's 8 rows holds 1 real token.
    assert [compute_local_num_token_non_padded(5, 8, 2, r) for r in range(2)] == [4, 1]
    model = build_random_model(default_config(), torch.float32, device, seed=0)
    eager = ModelRunner(model, max_reqs=4, max_context_len=32, backend=backend)
    expected = eager.generate(CROSSING_PROMPTS, 6, progress=False)
    ranks = launch(_crossing_tokens, 2, "inductor", device, backend, device=device, timeout_s=900,
                   sequence_parallel=True)  # fmt: skip
    for r, result in enumerate(ranks):
        for policy, path in (("full", "whole_model"), ("piecewise", "piecewise"), ("breakable", "breakable")):
            tokens, paths = result[policy]
            assert tokens == expected, f"rank {r}, graphs={policy}"
            assert path in paths, f"rank {r}, graphs={policy}: {paths}"
        assert result["num_token_non_padded"] == compute_local_num_token_non_padded(2, 4, 2, r) == [2, 0][r]


def test_sequence_parallel_padding_across_the_ranks_shares_gives_one_ranks_tokens_in_every_graph_path():
    _check_crossing("cpu", "torch")


@pytest.mark.gpu
def test_gpu_sequence_parallel_padding_across_the_ranks_shares_gives_one_ranks_tokens_in_every_graph_path():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    _check_crossing("cuda", "triton")


def _capture_rank_dependent_sizes() -> None:
    model = build_random_model(default_config(), torch.float32, "cpu", seed=0)
    runner = ModelRunner(model, max_reqs=8, max_context_len=96, backend="torch", graphs="piecewise")
    sizes = (1, 2, 4) if tensor_parallel().rank == 0 else (1, 2, 8)
    runner.capture_graphs(progress=False, capture_sizes=sizes, piece_compiler="eager")


def test_sizes_that_differ_between_ranks_are_refused_on_every_rank_with_both_lists():
    with pytest.raises(RankFailedError) as caught:
        launch(_capture_rank_dependent_sizes, 2, timeout_s=300)
    text = str(caught.value)
    assert "expected the same sizes on every rank" in text
    assert "rank 0: [4, 2, 1]" in text and "rank 1: [8, 2, 1]" in text


def test_the_command_line_runs_two_ranks_and_rank_0_alone_prints(capfd):
    from sgl_piecewise.engine.cli import main

    argv = ["bench", "--model", "random", "--device", "cpu", "--tp", "2", "--new-tokens", "4", "--graphs", "none,full"]
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert out.count("sgl-piecewise bench") == 1, out  # one table: rank 0's
    assert "full vs none: 16/16 generated tokens identical" in out


def test_verify_on_the_command_line_with_sequence_parallelism_passes_on_two_ranks(capfd):
    from sgl_piecewise.engine.cli import main

    argv = [
        "verify",
        "--device",
        "cpu",
        "--tp",
        "2",
        "--sequence-parallel",
        "--steps",
        "4",
        "--piece-compiler",
        "eager",
    ]
    assert main(argv) == 0
    captured = capfd.readouterr()
    assert captured.out.count("sgl-piecewise verify") == 1 and "MISMATCH" not in captured.out, captured.out
    assert captured.err.count("verify: 100%") <= 2, captured.err  # rank 0's bar only (refreshed once at the end)


def test_sequence_parallelism_at_one_rank_is_refused(capsys):
    from sgl_piecewise.engine.cli import main

    assert main(["verify", "--device", "cpu", "--sequence-parallel"]) == 2
    assert "--sequence-parallel: expected --tp 2 or more" in capsys.readouterr().out


def test_tp_other_than_torchruns_world_is_refused(monkeypatch, capsys):
    from sgl_piecewise.engine.cli import main

    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["verify", "--device", "cpu", "--tp", "2"]) == 2
    assert "--tp: expected torchrun's WORLD_SIZE (4) or no --tp, got 2" in capsys.readouterr().out


def _gpu_tokens_every_policy(prompts: list, new_tokens: int) -> dict:
    """Greedy tokens under each policy, and, at several ranks, how many
    projections fuse their all-reduce with the norm after it (FlashInfer)
    and whether a workspace serves a decode step."""
    model = build_random_model(default_config(), torch.float32, "cuda", seed=0)
    tokens = {}
    for policy in POLICIES:
        runner = ModelRunner(model, max_reqs=8, max_context_len=160, backend="triton", graphs=policy)
        graph_bs = [bs for bs in (1, 2, 4, 8) if bs % token_split() == 0]  # even under sequence parallelism
        runner.capture_graphs(progress=False, capture_bs=graph_bs, capture_sizes=(8, 16, 32, 64, 128, 256))
        tokens[policy] = runner.generate(prompts, new_tokens, progress=False)
    tp, hidden = tensor_parallel(), model.config.hidden_size
    step = torch.empty(7, hidden, device="cuda")
    served = tp.size > 1 and fused_norm.serving(tp.group_name, step) is not None
    fused = sum(getattr(m, "fuses_norm", False) for m in model.modules())
    return {"tokens": tokens, "fused": fused, "served": served}


@pytest.mark.gpu
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_gpu_two_ranks_generate_one_ranks_fp32_tokens_for_7_ragged_prompts_under_every_policy(sequence_parallel):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    rng = random.Random(7)
    prompts = [[rng.randrange(4096) for _ in range(rng.randint(24, 48))] for _ in range(7)]
    one = _gpu_tokens_every_policy(prompts, 64)["tokens"]
    two = launch(_gpu_tokens_every_policy, 2, prompts, 64, device="cuda", timeout_s=600,
                 sequence_parallel=sequence_parallel)  # fmt: skip
    # Without sequence parallelism and with FlashInfer, every row-parallel
    # projection fuses its all-reduce with the next norm (fused_norm.py).
    fusing = fused_norm.AVAILABLE and not sequence_parallel
    for policy in POLICIES:
        assert one[policy] == one["none"], f"one rank, graphs={policy}"
        for r in range(2):
            assert two[r]["tokens"][policy] == one["none"], f"rank {r} of 2, graphs={policy}"
    for r in range(2):
        layers = default_config().num_hidden_layers
        assert (two[r]["fused"], two[r]["served"]) == ((2 * layers, True) if fusing else (0, False)), f"rank {r}"


SPEC_CONFIG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=101, max_position_embeddings=128)  # fmt: skip


def _speculative_tokens(prompts: list, new_tokens: int, k: int) -> list:
    """Greedy speculative decoding through whole-model graphs of the three step
    kinds, the draft the target's first two layers."""
    from sgl_piecewise import ForwardMode
    from sgl_piecewise.engine.drafts import LayerSkipDraft
    from sgl_piecewise.engine.speculative import speculative_generate
    from sgl_piecewise.models import ModelConfig
    from sgl_piecewise.runners.whole_model import CudaGraphRunner

    model = build_random_model(ModelConfig(architecture="LlamaForCausalLM", **SPEC_CONFIG), seed=5, std=0.2)
    target = ModelRunner(model, max_reqs=6, max_context_len=96, backend="torch")
    draft = ModelRunner(LayerSkipDraft(model, 2), max_reqs=6, max_context_len=96, backend="torch")
    target.use_graphs(CudaGraphRunner(target, (1, 2, 4), modes=[ForwardMode.TARGET_VERIFY], num_tokens_per_req=k + 1),
                      progress=False)  # fmt: skip
    draft.use_graphs(CudaGraphRunner(draft, (1, 2, 4), modes=[ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND_V2],
                                     num_tokens_per_req=k + 1), progress=False)  # fmt: skip
    return speculative_generate(target, draft, prompts, new_tokens, k).tokens


def test_two_ranks_decode_speculatively_to_one_ranks_plain_greedy_tokens():
    from sgl_piecewise.models import ModelConfig

    rng = random.Random(3)
    prompts = [[rng.randrange(101) for _ in range(n)] for n in (5, 9, 3)]
    model = build_random_model(ModelConfig(architecture="LlamaForCausalLM", **SPEC_CONFIG), seed=5, std=0.2)
    plain = ModelRunner(model, max_reqs=6, max_context_len=96, backend="torch").generate(prompts, 12, progress=False)
    for rank_tokens in launch(_speculative_tokens, 2, prompts, 12, 3, timeout_s=300):
        assert rank_tokens == plain
