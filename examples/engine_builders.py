"""One graph policy for an engine: every step takes the fastest path that
serves it — whole-model graphs for decode, piecewise graphs for prefill and
mixed steps, eager otherwise — and is counted by the path it took.

Run: python examples/engine_builders.py [path/to/hf-checkpoint]
(without a path: the embedded default model, random weights)
"""

import sys

import torch

from sgl_piecewise.compile import counters, default_capture_sizes
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.models import load_model_or_default

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
model = load_model_or_default(sys.argv[1] if len(sys.argv) > 1 else None, dtype=dtype, device=device)
backend = "triton" if device == "cuda" else "torch"
runner = ModelRunner(model, max_reqs=64, max_context_len=512, backend=backend, graphs="auto")
# Prefill and mixed steps: pieces per token count up to 256; decode: one graph per batch size up to 64.
print(runner.capture_graphs(capture_sizes=default_capture_sizes(256)))  # what each path captured
print(runner.generate([[1, 2, 3], [4, 5]], max_new_tokens=64))
print(counters.format_step_paths())  # 1 prefill through pieces, 63 decode steps through whole-model graphs
