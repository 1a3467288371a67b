"""Building the triton backend where its kernels cannot run.

Triton runs kernels on CPU tensors only under its interpreter, which it picks
when the kernels are imported. This test process sets ``TRITON_INTERPRET``
first thing (conftest.py), so the case without it runs in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys

import sgl_piecewise

_BUILD_OVER_CPU_POOLS = """
from sgl_piecewise.backends import BackendUnavailableError
from sgl_piecewise.backends.factory import create_backend
from sgl_piecewise.memory import KVPool, ReqToTokenPool

try:
    create_backend("triton", ReqToTokenPool(max_reqs=2, max_context_len=16), KVPool(64, 1, 2, 16),
                   num_q_heads=4)
except BackendUnavailableError as exc:
    print("refused:", exc)
else:
    print("built")
"""


def test_triton_backend_over_cpu_pools_without_the_interpreter_says_to_set_triton_interpret():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The subprocess imports this checkout, wherever the package is installed from.
    root = os.path.dirname(os.path.dirname(sgl_piecewise.__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", _BUILD_OVER_CPU_POOLS], env=env,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: triton backend over a cpu KV pool: expected TRITON_INTERPRET=1 set "
                                  "in the environment before the Triton kernels are imported (or a CUDA device), "
                                  "got ")  # fmt: skip
