"""Whole-model decode graphs for an engine: one CUDA graph per batch size with
attention inside, piecewise graphs for the prefill.

Run: python examples/engine_builders.py [path/to/hf-checkpoint]
(without a path: the embedded default model, random weights)
"""

import sys

import torch

from sgl_piecewise.compile import CompiledModel, CompileOptions
from sgl_piecewise.models import load_model_or_default
from sgl_piecewise.runner import ModelRunner
from sgl_piecewise.runners import CudaGraphRunner, PiecewiseCudaGraphRunner

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
model = load_model_or_default(sys.argv[1] if len(sys.argv) > 1 else None, dtype=dtype, device=device)
backend = "triton" if device == "cuda" else "torch"
runner = ModelRunner(model, max_reqs=64, max_context_len=512, backend=backend)
# Prefill: the compiled pieces captured per token count, up to 256 tokens.
PiecewiseCudaGraphRunner(runner, CompileOptions(cudagraphs=True, max_capture_size=256)).capture()
# Decode: the whole step, Inductor's fused kernels and attention, one graph per batch size.
CudaGraphRunner(runner, forward=CompiledModel(model)).capture()  # SGLang's sizes up to 64, largest first
print(runner.generate([[1, 2, 3], [4, 5]], max_new_tokens=64))
