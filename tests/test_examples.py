"""The README's examples run as written: each is a file under ``examples/``
whose code the README shows verbatim, run here on the embedded default model."""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def code_after_docstring(path: Path) -> str:
    text = path.read_text()
    match = re.match(r'"""(?:.|\n)*?"""\n\n', text)
    return text[match.end() :] if match else text


# The tests that run an example, and the example each runs.
RUNS = {
    "test_model_authors_example_attends_the_ragged_batch": "model_authors.py",
    "test_compile_users_example_traces_once_and_replays_its_prefill": "compile_users.py",
    "test_engine_builders_example_routes_every_step_and_generates_64_tokens_per_prompt": "engine_builders.py",
    "test_speculative_decoding_example_gives_plain_greedy_tokens": "speculative_decoding.py",
    "test_transformers_models_example_gives_transformers_tokens": "transformers_models.py",
}


@pytest.fixture(scope="module")
def run(request, started_process):
    """``run(name)``: the stdout of ``examples/<name>`` run as a user runs it,
    in a process of its own (it must exit with 0 within 600 s of the call).

    The examples the selected tests run all start when the first of those
    tests starts: none reads what another writes (Inductor's cache takes
    concurrent compiles) and each keeps mostly one core busy, so on two
    cores they run side by side; each test waits for its own. Any still
    running when the module ends is stopped."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}

    def start(name: str):
        return started_process([sys.executable, ROOT / "examples" / name], env, timeout=600, cwd=ROOT)

    mine = [item.originalname for item in request.session.items if getattr(item, "module", None) is request.module]
    started = {RUNS[test]: start(RUNS[test]) for test in mine if test in RUNS}

    def output(name: str) -> str:
        if name not in started:  # a test RUNS does not name: started now, alone
            started[name] = start(name)
        return started[name].stdout()

    yield output
    for process in started.values():
        process.stop()


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= {"model_authors.py", "compile_users.py", "engine_builders.py",
                                          "speculative_decoding.py", "transformers_models.py"}  # fmt: skip


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_readme_shows_each_example_verbatim(path):
    readme = (ROOT / "README.md").read_text()
    assert f"```python\n{code_after_docstring(path)}```" in readme, f"README's copy of {path.name} differs"


def test_model_authors_example_attends_the_ragged_batch(run):
    assert run("model_authors.py").strip() == "8 new tokens -> output (8, 64)"


def test_compile_users_example_traces_once_and_replays_its_prefill(run):
    lines = run("compile_users.py").strip().splitlines()
    first, second, counters = lines[-3], lines[-2], ast.literal_eval(lines[-1])
    assert first == second  # the graphs give the tokens the first run's captures gave
    # One Dynamo graph for every token count: no recompile. The default model
    # has 4 layers, so 5 pieces around attention, 3 distinct compiles (first,
    # middle ones shared, last). Sizes used: 8 (the 5-token prefill) and 2
    # (decode): 2 x 5 captures. Replays: run 1 replays 14 decode steps (its
    # prefill and first decode step captured), run 2 replays its prefill and
    # 15 decode steps: (14 + 16) x 5 = 150. Every one of the 2 x 16 steps
    # ran the compiled model installed as model_forward (no graph policy),
    # and none ran again (the weights stayed put). The 3 compiles wait for their kernels after the last one's lowering
    # wherever Inductor builds them in worker processes (two or more cores).
    assert counters == {"graphs_split": 1, "pieces_seen": 5, "pieces_compiled": 3, "graphs_captured": 10,
                        "replays": 150, "eager_fallbacks": {}, "artifacts_loaded": 0, "artifacts_saved": 0,
                        "compiles_loaded": 0, "compiles_saved": 0, "steps_rerun": 0,
                        "step_paths": {"model_forward: graphs='none'": 32}}  # fmt: skip


def test_engine_builders_example_routes_every_step_and_generates_64_tokens_per_prompt(run):
    lines = run("engine_builders.py").strip().splitlines()
    assert lines[:3] == [
        lines[0],
        "  piecewise: 36 sizes, tokens 1..256",
        "  whole_model: 12 sizes, bs 1..64, the compiled model",
    ]
    (tokens,) = [ast.literal_eval(line) for line in lines if line.startswith("[[")]
    assert [len(t) for t in tokens] == [64, 64]
    # 2 prompts of 3 and 2 tokens: one prefill of 5 tokens (pads to 8), then
    # 63 decode steps of bs 2 (a whole-model graph of its own).
    assert lines[-5:] == [
        "64 steps",
        "  whole_model        63   98.4%",
        "           63  DECODE bs 2 -> 2",
        "  piecewise           1    1.6%",
        "            1  EXTEND 5 -> 8 tokens",
    ]


def test_speculative_decoding_example_gives_plain_greedy_tokens(run):
    lines = run("speculative_decoding.py").strip().splitlines()
    assert lines[-2] == "True"  # exactly plain greedy's tokens
    assert re.fullmatch(r"acceptance rate [01]\.\d\d, \d+ verify steps for 15 tokens", lines[-1]), lines[-1]


def test_transformers_models_example_gives_transformers_tokens(run):
    assert run("transformers_models.py").strip().splitlines()[-1] == "True"
