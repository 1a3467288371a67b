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
import threading
import time

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

import sgl_piecewise  # noqa: E402
from sgl_piecewise.backends.triton_kernels import compile_child, extend  # noqa: E402
from sgl_piecewise.engine.runner import ModelRunner  # noqa: E402
from sgl_piecewise.errors import InvalidInputError  # noqa: E402
from sgl_piecewise.models import ModelConfig, build_random_model  # noqa: E402


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
    # With a CUDA driver each compile is begun ("start") and fails; without
    # one, every compile fails before it begins.
    lines = [line for line in done.stdout.splitlines() if not line.startswith("start ")]
    assert [line.split()[:2] for line in lines[:2]] == [["failed", "0"], ["failed", "1"]]
    assert lines[2:] in (["context 0"], ["context ?"])  # "?": a machine with no CUDA driver to ask


# A child that speaks the protocol and holds its first compile until told to
# finish it (a line on its stdin): the parent's side, timed by the test.
_HELD_CHILD = r"""
import sys
print("start 0", flush=True)
sys.stdin.readline()
print("done 0", flush=True)
print("context 0", flush=True)
"""


def test_a_first_launch_waits_for_a_compile_the_child_has_begun_and_not_for_others():
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    process = subprocess.Popen([sys.executable, "-c", _HELD_CHILD], text=True, **pipes)
    child = compile_child._Child(process, [("kernel:a", {"BLOCK_M": 128}), ("kernel:a", {"BLOCK_M": 64})])
    deadline = time.monotonic() + 60
    while 0 not in child.started_compiles and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 0 in child.started_compiles
    assert not child.wait("kernel:a", {"BLOCK_M": 64}, timeout=60), "not begun: compiled in the process at once"
    assert not child.wait("kernel:b", {"BLOCK_M": 128}, timeout=60), "never given to the child"
    results: list = []
    waiting = threading.Thread(target=lambda: results.append(child.wait("kernel:a", {"BLOCK_M": 128}, timeout=60)))
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive(), "a begun compile is waited for"
    process.stdin.write("finish\n")
    process.stdin.flush()
    waiting.join(60)
    assert results == [True]
    child.reader.join(60)
    assert child.answers == {0: "done"} and child.opened_context is False and child.seconds is not None
    assert child.events[1].is_set(), "once the child exits, nothing of it is waited for"


def test_no_child_when_switched_off_or_for_a_cpu_or_for_arguments_json_cannot_carry(monkeypatch):
    monkeypatch.setattr(compile_child, "_children", [])
    monkeypatch.setattr(compile_child, "_given", set())
    kernel = extend._extend_kernel
    monkeypatch.setenv(compile_child.ENV_SWITCH, "0")
    assert not compile_child.compile_in_child(kernel, [([torch.int32], {})], torch.device("cuda"))
    monkeypatch.setenv(compile_child.ENV_SWITCH, "off")  # a switch it does not know is refused, not guessed
    with pytest.raises(InvalidInputError, match=r"SGL_PIECEWISE_COMPILE_CHILD: expected 0 .* or 1 .*, got 'off'"):
        compile_child.compile_in_child(kernel, [([torch.int32], {})], torch.device("cuda"))
    monkeypatch.delenv(compile_child.ENV_SWITCH)
    assert not compile_child.compile_in_child(kernel, [([torch.int32], {})], torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert not compile_child.compile_in_child(kernel, [([torch.zeros(1)], {})], torch.device("cuda"))
    assert compile_child._children == [] and compile_child._given == set()
    assert not compile_child.wait_for_child(kernel, {})  # no child: nothing to wait for


def test_a_child_starts_only_for_compiles_no_child_of_the_process_was_given(monkeypatch):
    monkeypatch.setattr(compile_child, "_children", [])
    monkeypatch.setattr(compile_child, "_given", set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    started = []
    monkeypatch.setattr(
        compile_child, "_start_child", lambda capability, compiles: started.append(compiles) or object()
    )
    kernel, cuda = extend._extend_kernel, torch.device("cuda")
    a, b, c = (
        ([torch.bfloat16, 64], {"BLOCK_M": 128}),
        ([torch.bfloat16, 64], {"BLOCK_M": 64}),
        ([torch.float16, 64], {"BLOCK_M": 64}),
    )
    assert compile_child.compile_in_child(kernel, [a, b], cuda)
    assert compile_child.compile_in_child(kernel, [b, c], cuda)
    assert not compile_child.compile_in_child(kernel, [a, c], cuda)
    assert [[e["meta"]["BLOCK_M"] for e in compiles] for compiles in started] == [[128, 64], [64]]
    assert started[1][0]["args"] == [{"dtype": "float16"}, 64]
    assert len(compile_child._children) == 2


# A fresh process with an empty Triton cache: a triton backend over CUDA
# pools starts the child; once it has answered, a prefill's extend launches
# compile nothing more of the kernel (no new cache entry of it).
_FIRST_LAUNCH_FINDS_THE_CHILDS_COMPILE = r"""
import glob, json, os, sys, torch
from sgl_piecewise.backends.triton_kernels import compile_child
from sgl_piecewise.models import ModelConfig, build_random_model
from sgl_piecewise.engine.runner import ModelRunner

config = ModelConfig(**json.loads(sys.argv[1]))
model = build_random_model(config, torch.bfloat16, "cuda", seed=0)
runner = ModelRunner(model, max_reqs=2, max_context_len=128, backend="triton")
ModelRunner(model, max_reqs=1, max_context_len=32, backend="triton")
children = compile_child._children
for child in children:
    child.reader.join(300)

def compiled():
    return sorted(glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", "_extend_kernel.json")))

before = compiled()
runner.generate([list(range(1, 100)), list(range(3, 9))], max_new_tokens=2, progress=False)
new = len(set(compiled()) - set(before))
print(json.dumps({"children": compile_child.child_answers(), "before": len(before), "new": new,
                  "compiles": sum(len(child.compiles) for child in children)}))
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
    # One child: the second backend (of the same shapes) started none.
    (child,) = result["children"]
    assert sorted(child["answers"].values()) == ["done"] * result["compiles"], child
    assert child["opened_context"] is False, "the child must not open a CUDA context"
    assert result["before"] == result["compiles"], "each compile leaves one cache entry"
    assert result["new"] == 0, "the parent compiled the extend kernel again: the prediction missed"
