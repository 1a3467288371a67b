"""The extend kernel compiled by a child process ahead of a start-up's first
launch (``backends/triton_kernels/compile_child.py``): the prediction
matches the launches our models make, the child answers for every compile
and opens no CUDA context, and the parent's first launch then finds the
kernel in Triton's cache instead of compiling it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

import sgl_piecewise  # noqa: E402
from sgl_piecewise.backends.triton_kernels import compile_child, extend  # noqa: E402
from sgl_piecewise.models import ModelConfig, build_random_model  # noqa: E402
from sgl_piecewise.runner import ModelRunner  # noqa: E402


def _specialisation(arg):
    """What Triton compiles a launch's argument for: a tensor (or a dtype
    standing in for one) by dtype and 16-byte alignment, an integer by
    being 1, its divisibility by 16 and its width, a float by its type."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, torch.dtype):
        return arg, True
    if isinstance(arg, bool):
        return "bool", arg
    if isinstance(arg, int):
        return "int", arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31
    return type(arg).__name__


def _config(architecture: str = "Qwen2ForCausalLM", **overrides) -> ModelConfig:
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)  # fmt: skip
    return ModelConfig(architecture=architecture, qkv_bias=architecture.startswith("Qwen2"), **{**shape, **overrides})


@pytest.mark.triton_cpu
@pytest.mark.parametrize(
    "config",
    [_config(), _config("LlamaForCausalLM", hidden_size=112, num_attention_heads=7, num_key_value_heads=1)],
    ids=["qwen2", "llama-7-heads"],
)
def test_predicted_compiles_specialise_as_a_models_extend_launches(config, monkeypatch):
    launched = []
    real_args = extend._extend_args

    def recorded(*a):
        grid, args, meta = real_args(*a)
        launched.append((args, meta))
        return grid, args, meta

    monkeypatch.setattr(extend, "_extend_args", recorded)
    model = build_random_model(config, seed=0)
    runner = ModelRunner(model, max_reqs=2, max_context_len=64, backend="triton")
    runner.generate([list(range(1, 40)), list(range(3, 9))], max_new_tokens=1, progress=False)
    assert launched, "the prefill launched no extend kernel"

    head_dim = config.hidden_size // config.num_attention_heads
    predicted = extend.predicted_start_up_compiles(config.num_attention_heads, config.num_key_value_heads,
                                                   head_dim, head_dim, torch.float32)  # fmt: skip
    assert [m["BLOCK_M"] for _, m in predicted] == sorted({m["BLOCK_M"] for _, m in predicted}, reverse=True)
    for args, meta in launched:
        assert meta["NEW_KV"], "a plain prefill writes its K/V inside the attention kernel"
        assert meta in [m for _, m in predicted], f"no predicted compile has the launch's settings {meta}"
        stand_ins = predicted[0][0]
        assert list(map(_specialisation, args)) == list(map(_specialisation, stand_ins))


def _run_child(request: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", compile_child.__name__], input=json.dumps(request),
                          capture_output=True, text=True, timeout=300, env=_child_env())  # fmt: skip


def _child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(sgl_piecewise.__file__))  # this checkout, wherever installed from
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def test_the_child_answers_for_every_compile_it_cannot_do_and_exits_cleanly():
    request = {
        "capability": [9, 0],
        "compiles": [{"kernel": "sgl_piecewise.backends.triton_kernels.extend:no_such_kernel", "args": [], "meta": {}},
                     {"kernel": "no_such_module:kernel", "args": [{"dtype": "bfloat16"}], "meta": {}}],
    }  # fmt: skip
    done = _run_child(request)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[:2] for line in lines[:2]] == [["failed", "0"], ["failed", "1"]]
    assert lines[2:] in (["context 0"], ["context ?"])  # "?": a machine with no CUDA driver to ask


def test_a_parent_waits_only_for_compiles_of_its_kernel_and_settings():
    request = {"capability": [9, 0], "compiles": [{"kernel": "no_such_module:kernel", "args": [], "meta": {"A": 1}}]}
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    process = subprocess.Popen([sys.executable, "-m", compile_child.__name__], text=True, env=_child_env(), **pipes)
    process.stdin.write(json.dumps(request))
    process.stdin.close()
    child = compile_child._Child(process, [("no_such_module:kernel", {"A": 1})])
    assert not child.wait("no_such_module:kernel", {"A": 2}, timeout=60), "nothing of those settings was given"
    assert not child.wait("other:kernel", {"A": 1}, timeout=60)
    assert child.wait("no_such_module:kernel", {"A": 1}, timeout=60)
    child.reader.join(60)
    assert child.answers[0].startswith("failed: ")  # no such module (or, without CUDA, no card)
    assert child.opened_context is not True


def test_no_child_when_switched_off_or_for_a_cpu_or_for_arguments_json_cannot_carry(monkeypatch):
    monkeypatch.setattr(compile_child, "_child", None)
    kernel = extend._extend_kernel
    monkeypatch.setenv(compile_child.ENV_SWITCH, "0")
    assert not compile_child.compile_in_child(kernel, [([torch.int32], {})], torch.device("cuda"))
    monkeypatch.delenv(compile_child.ENV_SWITCH)
    assert not compile_child.compile_in_child(kernel, [([torch.int32], {})], torch.device("cpu"))
    if torch.cuda.is_available():
        assert not compile_child.compile_in_child(kernel, [([torch.zeros(1)], {})], torch.device("cuda"))
    assert compile_child._child is None
    assert not compile_child.wait_for_child(kernel, {})  # no child: nothing to wait for


# A fresh process with an empty Triton cache: a triton backend over CUDA
# pools starts the child; once it has answered, a prefill's extend launches
# compile nothing more of the kernel (no new cache entry of it).
_FIRST_LAUNCH_FINDS_THE_CHILDS_COMPILE = r"""
import glob, json, os, sys, torch
from sgl_piecewise.backends.triton_kernels import compile_child
from sgl_piecewise.models import ModelConfig, build_random_model
from sgl_piecewise.runner import ModelRunner

config = ModelConfig(**json.loads(sys.argv[1]))
model = build_random_model(config, torch.bfloat16, "cuda", seed=0)
runner = ModelRunner(model, max_reqs=2, max_context_len=128, backend="triton")
child = compile_child._child
child.reader.join(300)

def compiled():
    return sorted(glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", "_extend_kernel.json")))

before = compiled()
runner.generate([list(range(1, 100)), list(range(3, 9))], max_new_tokens=2, progress=False)
new = len(set(compiled()) - set(before))
print(json.dumps({"answers": compile_child.child_answers(), "before": len(before), "new": new,
                  "compiles": len(child.compiles)}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("config", [_config(hidden_size=896, num_attention_heads=14),
                                    _config("LlamaForCausalLM", hidden_size=1024, num_attention_heads=8,
                                            num_key_value_heads=8)],
                         ids=["qwen2-14-heads-d64", "llama-8-heads-d128"])  # fmt: skip
def test_a_prefills_first_extend_launch_finds_the_childs_compile(config, tmp_path):
    env = {**_child_env(), "TRITON_CACHE_DIR": str(tmp_path / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    names = ("architecture", "qkv_bias", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "vocab_size", "max_position_embeddings")  # fmt: skip
    fields = {k: getattr(config, k) for k in names}
    done = subprocess.run([sys.executable, "-c", _FIRST_LAUNCH_FINDS_THE_CHILDS_COMPILE, json.dumps(fields)],
                          capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    answers = result["answers"]
    assert sorted(answers["answers"].values()) == ["done"] * result["compiles"], answers
    assert answers["opened_context"] is False, "the child must not open a CUDA context"
    assert result["before"] == result["compiles"], "each compile leaves one cache entry"
    assert result["new"] == 0, "the parent compiled the extend kernel again: the prediction missed"
