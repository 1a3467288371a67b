"""Greedy speculative decoding with whole-model graphs: a layer-skip draft
(the target's first two layers and its LM head) proposes 3 tokens, the
target verifies them in one step; the output is exactly plain greedy's.

Run with a local checkpoint path as argument, or on the embedded default
model (random weights: the draft is rarely right, the output still exact).
"""

import sys

import torch

from sgl_piecewise import ForwardMode
from sgl_piecewise.engine.drafts import LayerSkipDraft
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.engine.speculative import speculative_generate
from sgl_piecewise.models import load_model_or_default
from sgl_piecewise.runners import CudaGraphRunner

device = "cuda" if torch.cuda.is_available() else "cpu"
model = load_model_or_default(sys.argv[1] if len(sys.argv) > 1 else None, dtype=torch.float32, device=device)
k = 3  # draft tokens per step: verify and draft extend carry k + 1 tokens per request
target = ModelRunner(model, max_reqs=8, max_context_len=256, backend="torch")
draft = ModelRunner(LayerSkipDraft(model, num_layers=2), max_reqs=8, max_context_len=256, backend="torch")
for runner, mode in ((target, ForwardMode.TARGET_VERIFY), (draft, ForwardMode.DRAFT_EXTEND_V2)):
    runner.use_graphs(CudaGraphRunner(runner, modes=[ForwardMode.DECODE, mode], num_tokens_per_req=k + 1))
prompts = [[1, 2, 3], [4, 5]]
out = speculative_generate(target, draft, prompts, max_new_tokens=16, num_draft_tokens=k)
print(out.tokens == target.generate(prompts, max_new_tokens=16))  # float32: exactly plain greedy's tokens
print(f"acceptance rate {out.stats.acceptance_rate:.2f}, {out.stats.rounds} verify steps for 15 tokens")
