"""Your transformers model through the library: a Qwen3 config here (a random
model, offline); a checkpoint directory with ``load_model(path)`` the same way."""

import torch
import transformers

from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.models import from_config

config = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
model = from_config(config, seed=0)  # or load_model("path/to/checkpoint"), or adapt(your_hf_model)
runner = ModelRunner(model, max_reqs=4, max_context_len=128, backend="torch", graphs="auto")
runner.capture_graphs(progress=False)
hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
hf.load_state_dict(model.hf_model.state_dict())
theirs = hf.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=8, do_sample=False)[0, 4:].tolist()
print(runner.generate([[1, 2, 3, 4], [5, 6]], max_new_tokens=8)[0] == theirs)  # transformers' greedy tokens
