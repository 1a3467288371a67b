"""The command-line main job (README's first command), end to end on the CPU."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from conftest import smollm2_or_skip
from safetensors.torch import load_file, save_file

from sgl_piecewise.engine.bench import ragged_prompts, run_policy
from sgl_piecewise.engine.cli import build_parser, main
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.models import load_model, load_model_or_default

# Each compile here adds a Dynamo cache entry for the same model code; entries
# left by other tests must not push it past the recompile limit.
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_bench_runs_every_policy_and_they_agree(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line
    argv = ["bench", "--model", "random", "--device", "cpu", "--batch-size", "3", "--prompt-len", "10",
            "--new-tokens", "4", "--max-capture-size", "16", "--piece-compiler", "eager"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    for policy in ("full", "piecewise", "breakable", "auto"):
        assert f"{policy} vs none: 12/12 generated tokens identical" in out
    # 3 prompts of 8, 8 and 5 tokens (seed 0), 4 new tokens: 1 prefill of 21
    # tokens (above the largest token graph, 16: eager), 3 decode steps of bs 3.
    expected = {"none": "eager 4", "full": "eager 1, whole_model 3", "piecewise": "eager 1, piecewise 3",
                "breakable": "eager 1, breakable 3", "auto": "eager 1, whole_model 3"}  # fmt: skip
    for policy, paths in expected.items():
        assert re.search(rf"│ {policy} .*│ {paths} ", out), policy
    assert "check: outputs agree" in out
    # auto's whole-model graphs hold the model its pieces were compiled from, full's the eager one.
    assert "  piecewise: piecewise graphs of the model's pieces (piece compiler eager)" in out
    assert re.search(r"  auto: piecewise graphs .*; whole-model graphs: .*, the compiled model\n", out), out


def test_bench_rejects_unknown_policies_naming_the_valid_ones(capsys):
    assert main(["bench", "--device", "cpu", "--graphs", "none,turbo"]) == 2
    assert re.match(r"error: --graphs: expected a comma-separated subset of .*'breakable'", capsys.readouterr().out)


@pytest.fixture
def nothing_starts(monkeypatch):
    """A check that must come first: no model loads and no rank starts before it."""
    import sgl_piecewise.engine.cli as cli
    import sgl_piecewise.models.loader as loader

    def must_not_run(*args, **kwargs):
        raise AssertionError("a model was loaded or a rank started before the flags were checked")

    monkeypatch.setattr(loader, "load_model_or_default", must_not_run)
    monkeypatch.setattr(cli, "launch", must_not_run)


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--graphs", "fast"], "--graphs: expected a comma-separated subset of ('auto', 'full', "),
        (["verify", "--graphs", "none"], "--graphs: expected a comma-separated subset of ('auto', 'full', "),
        (["bench", "--device", "foo"], "--device: expected cpu, cuda, cuda:N or auto, got 'foo'"),
        pytest.param(["bench", "--device", "cuda"], "--device cuda: expected a CUDA device, got none", marks=NO_CUDA),
        (["bench", "--tp", "2", "--graphs", "fast"], "--graphs: expected a comma-separated subset of "),
    ],
)
def test_every_bad_flag_is_one_error_line_and_exit_2(argv, message, capsys, nothing_starts):
    assert main([*argv, "--model", "random"]) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"error: {message}") and out.count("\n") == 1, out


@pytest.mark.parametrize("model", ["random", "checkpoint"])
def test_a_tp_size_the_model_does_not_split_over_is_refused_before_any_rank_starts(
    model, tiny_checkpoint, capsys, nothing_starts
):
    # Both have 4 attention heads: 3 ranks would hold a head and a third each.
    name = str(tiny_checkpoint) if model == "checkpoint" else model
    assert main(["bench", "--device", "cpu", "--model", name, "--tp", "3"]) == 2
    assert capsys.readouterr().out == (
        f"error: --tp 3 (--model {name}): num_attention_heads: expected a multiple of the tensor-parallel "
        "size 3, got 4; use a --tp among [1, 2, 4]\n"
    )


def test_an_architecture_of_the_transformers_adapter_is_refused_above_one_rank(tmp_path, capsys, nothing_starts):
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    assert main(["bench", "--device", "cpu", "--model", str(tmp_path), "--tp", "2"]) == 2
    assert capsys.readouterr().out == (
        f"error: --tp 2 (--model {tmp_path}): expected --tp 1 for Qwen3ForCausalLM, which runs on one rank "
        "through the transformers adapter\n"
    )


def test_the_default_model_at_tp_2_is_refused_from_its_gguf_metadata(capsys, nothing_starts, monkeypatch):
    """SmolLM2 has 9 attention heads and 3 KV heads: 3 ranks split it, 2 do not."""
    pytest.importorskip("gguf", reason="GGUF reading: pip install gguf")
    smollm2_or_skip()
    monkeypatch.setenv("COLUMNS", "80")  # the error stays one line however narrow the terminal
    assert main(["bench", "--device", "cpu", "--tp", "2"]) == 2
    assert capsys.readouterr().out == (
        "error: --tp 2 (--model smollm2): num_attention_heads: expected a multiple of the tensor-parallel "
        "size 2, got 9; use a --tp among [1, 3]\n"
    )


def test_a_cpu_bench_shows_paths_and_agreement_but_no_times(capsys, monkeypatch):
    """On a CPU a graph replay runs its model directly: the policies' times
    compare no graphs, so none is shown; what each policy built is said."""
    monkeypatch.setenv("COLUMNS", "200")
    argv = ["bench", "--model", "random", "--device", "cpu", "--batch-size", "2", "--prompt-len", "6",
            "--new-tokens", "3", "--graphs", "none,full,breakable", "--max-capture-size", "16"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "sgl-piecewise bench (tp 1)" in out
    assert re.search(r"┃ graphs +┃ steps by path +┃\n", out) and not re.search(r"\d\.\d+x", out), out
    assert re.search(r"│ full +│ eager 1, whole_model 2 +│", out), out
    assert "full vs none: 6/6 generated tokens identical" in out and "check: outputs agree" in out
    assert "  none: no graphs, every step eager" in out
    assert "  full: whole-model graphs: 2 sizes, bs 1..2, the eager model" in out
    assert "  breakable: breakable graphs of the eager model (cut at each attention call, nothing compiled)" in out


@pytest.mark.parametrize("flag", ["--batch-size", "--prompt-len", "--new-tokens", "--max-capture-size"])
def test_bench_rejects_non_positive_sizes_with_the_reason(flag, capsys):
    assert main(["bench", "--device", "cpu", flag, "0"]) == 2
    assert f"error: {flag}: expected a positive int, got 0" in capsys.readouterr().out


@pytest.fixture
def tiny_checkpoint(tmp_path):
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=64,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    return tmp_path


def _load_error(path) -> str:
    with pytest.raises(InvalidInputError) as info:
        load_model(path)
    return str(info.value)


def test_error_text_in_square_brackets_is_printed_literally(tiny_checkpoint, capsys):
    weights = load_file(tiny_checkpoint / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tiny_checkpoint / "model.safetensors")
    assert main(["bench", "--device", "cpu", "--model", str(tiny_checkpoint)]) == 2
    assert "got missing [model.layers.1.mlp.up_proj.weight]" in capsys.readouterr().out


def test_long_error_is_one_line_when_output_is_not_a_terminal(tiny_checkpoint, capsys):
    (tiny_checkpoint / "config.json").write_text("{")
    message = _load_error(tiny_checkpoint)
    assert len(message) > 100
    assert main(["bench", "--device", "cpu", "--model", str(tiny_checkpoint)]) == 2
    assert f"error: {message}\n" in capsys.readouterr().out


def test_a_backend_without_graph_hooks_is_refused_before_the_model_loads(capsys, monkeypatch):
    import sgl_piecewise.models.loader as loader

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the backend was checked")

    monkeypatch.setattr(loader, "load_model_or_default", must_not_load)
    assert main(["bench", "--device", "cpu", "--backend", "reference", "--graphs", "none,full"]) == 2
    assert "--backend reference: expected a backend with graph hooks for --graphs full" in capsys.readouterr().out
    assert main(["verify", "--device", "cpu", "--backend", "reference", "--graphs", "full"]) == 2
    assert main(["verify", "--device", "cpu", "--backend", "turbo"]) == 2
    assert (
        "--backend: expected one of ['reference', 'torch', 'triton', 'flashinfer'], got 'turbo'"
        in capsys.readouterr().out
    )


def test_one_new_token_prints_no_nan(capsys):
    argv = ["bench", "--model", "random", "--device", "cpu", "--batch-size", "2", "--prompt-len", "6",
            "--new-tokens", "1", "--graphs", "none,piecewise", "--max-capture-size", "16",
            "--piece-compiler", "eager"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "nan" not in out.lower() and "check: outputs agree" in out


def test_help_shows_no_raw_markup(capsys):
    for argv in (["--help"], ["bench", "--help"], ["verify", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "``" not in capsys.readouterr().out


def test_verify_shows_every_batch_size_it_drew_however_narrow_the_terminal(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    # One policy is enough to fill the table (every policy: three times as long).
    assert main(["verify", "--device", "cpu", "--steps", "12", "--max-bs", "6", "--graphs", "full"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out


def test_bench_compiles_and_captures_nothing_while_it_times(capsys):
    """Every step size of the timed run was compiled and captured in the
    untimed run before it, so no compile lands inside a timed step; on a CPU
    the table says that its times are no graph speed-up."""
    argv = ["bench", "--model", "random", "--device", "cpu", "--batch-size", "3", "--prompt-len", "10",
            "--new-tokens", "6", "--max-capture-size", "16", "--graphs", "none,auto"]  # fmt: skip
    args = build_parser().parse_args(argv)
    model = load_model_or_default(None, torch.float32, torch.device("cpu"), seed=0)
    prompts = ragged_prompts(3, 10, model.config.vocab_size, 0)
    result = run_policy("auto", model, args, prompts)
    assert result.paths == "eager 1, whole_model 5"
    assert result.compiled_while_timed == 0
    assert main(argv) == 0
    assert "a graph capture is a pass-through" in capsys.readouterr().out


def test_a_differing_token_is_reported_with_eager_logit_gap():
    """bench's text check names, at the first differing token, how far apart
    eager's logits held the two tokens: eager's own choice leads by the gap."""
    from sgl_piecewise.engine.bench import logit_gap_note
    from sgl_piecewise.engine.testing import prefill_logits

    model = load_model_or_default(None)
    prompt = [5, 9, 17, 3]
    logits = prefill_logits(model, prompt)[-1]
    first, second = logits.topk(2).indices.tolist()
    note = logit_gap_note(model, prompt, [first], [second], 0)
    gap = float(re.search(r"logit gap (\S+) of", note).group(1))
    assert f"{first} vs {second}" in note
    assert gap == pytest.approx(float(logits[first] - logits[second]), rel=1e-3) and gap >= 0
    assert "ends there" in logit_gap_note(model, prompt, [first], [], 0)


def test_verify_with_the_fused_projection_ops(capsys):
    from sgl_piecewise.engine.bench import load_model
    from sgl_piecewise.engine.cli import build_parser

    args = build_parser().parse_args(["verify", "--device", "cpu", "--fused-projections"])
    _, _, model = load_model(args)
    flags = [m.fused_projections for m in model.modules() if hasattr(m, "fused_projections")]
    assert len(flags) > model.config.num_hidden_layers and all(flags)
    argv = ["verify", "--device", "cpu", "--fused-projections", "--graphs", "piecewise", "--steps", "3",
            "--max-bs", "2", "--piece-compiler", "eager"]  # fmt: skip
    assert main(argv) == 0
    assert "MISMATCH" not in capsys.readouterr().out
    assert main(["verify", "--device", "cpu", "--fused-projections", "--tp", "2"]) == 2
    assert "--fused-projections: expected one rank, got 2" in capsys.readouterr().out
