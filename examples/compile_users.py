"""torch.compile with the sgl_piecewise backend: attention stays outside the
compiled pieces, each piece becomes a CUDA graph per token count.

Run: python examples/compile_users.py [path/to/hf-checkpoint]
(without a path: the embedded default model, random weights)
"""

import sys

import torch

import sgl_piecewise  # noqa: F401  (an installed package also registers the backend by entry point)
from sgl_piecewise.compile import counters
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.models import load_model_or_default

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
model = load_model_or_default(sys.argv[1] if len(sys.argv) > 1 else None, dtype=dtype, device=device)
runner = ModelRunner(model, max_reqs=32, max_context_len=512)
runner.model_forward = torch.compile(model, backend="sgl_piecewise", mode="reduce-overhead")
prompts = [[1, 2, 3], [4, 5]]
print(runner.generate(prompts, max_new_tokens=16))  # first use of a size captures its graphs
print(runner.generate(prompts, max_new_tokens=16))  # now prefill and decode steps replay them
print(counters.as_dict())  # one graph split, no eager fallback
