"""Speculative decoding benchmark (a script, not a test): plain greedy vs
greedy speculative decoding, whole-model graphs for every decode-like step
(target: DECODE and TARGET_VERIFY; draft: DECODE and DRAFT_EXTEND_V2), for
each draft and batch size: acceptance rate, tokens per second of both, the
speed-up, target steps.

    python benchmarks/bench_speculative.py --out results/                  # H200: Qwen2.5-0.5B shape, bf16
    python benchmarks/bench_speculative.py --model DIR --out results/      # a real checkpoint
    python benchmarks/bench_speculative.py --device cpu --tiny --out /tmp/ # the logic, on a CPU, in seconds

Random weights make the layer-skip draft a poor guess; a real checkpoint
gives it a meaningful acceptance rate. ``self`` (the target as its own
draft) bounds the speed-up from above, ``random`` from below. In bf16 the
verify and decode kernels round differently, so token identity is recorded,
not required. Writes ``speculative.json``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
from common import QWEN_05B, write_json  # noqa: E402 (benchmarks/ is the script's folder)

from sgl_piecewise.engine.drafts import parse_draft_spec
from sgl_piecewise.engine.speculative_bench import compare_greedy_and_speculative
from sgl_piecewise.models import ModelConfig, build_random_model, load_model

TINY = dict(
    architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=101, max_position_embeddings=256,
)  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for speculative.json")
    p.add_argument("--model", default=None, help="Hugging Face checkpoint dir (default: random weights)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--backend", default=None, help="default: triton on cuda, torch on cpu")
    p.add_argument("--tiny", action="store_true", help="a 4-layer model of 101 tokens (a smoke test)")
    p.add_argument("--drafts", default="self:4,self-layers:6:4,random:4")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_model(args, dtype):
    if args.model:
        return load_model(args.model, dtype=dtype, device=args.device)
    config = ModelConfig.from_hf_dict(TINY if args.tiny else QWEN_05B)
    return build_random_model(config, dtype, args.device, seed=args.seed, std=0.2 if args.tiny else 0.02)


def prompts_for(bs: int, prompt_len: int, vocab: int, rng: random.Random):
    """Ragged prompts, from half the length to the full length."""
    return [[rng.randrange(vocab) for _ in range(rng.randint(max(1, prompt_len // 2), prompt_len))] for _ in range(bs)]


def main(argv=None) -> dict:
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    backend = args.backend or ("triton" if cuda else "torch")
    model = build_model(args, dtype)
    drafts = [parse_draft_spec(d) for d in args.drafts.split(",")]
    layers = model.config.num_hidden_layers
    drafts = [d for d in drafts if d.num_layers is None or d.num_layers < layers]  # a tiny model has fewer
    rng = random.Random(args.seed)
    result = {
        "card": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "backend": backend,
        "dtype": str(dtype),
        "model": args.model or ("tiny" if args.tiny else "Qwen2.5-0.5B shape, random weights"),
        "argv": sys.argv if argv is None else argv,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "runs": [],
    }
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        prompts = prompts_for(bs, args.prompt_len, model.config.vocab_size, rng)
        for spec in drafts:
            run = compare_greedy_and_speculative(model, spec, prompts, args.new_tokens, backend)
            run["batch_size"] = bs
            result["runs"].append(run)
            print(f"bs {bs:3d} draft {str(spec):16s} acceptance {run['acceptance_rate']:.2f} "
                  f"plain {run['plain_tokens_per_s']:9.1f} tok/s speculative {run['speculative_tokens_per_s']:9.1f} "
                  f"tok/s ({run['speedup']:.2f}x) identical {run['identical_tokens']}", flush=True)  # fmt: skip
    write_json(args.out, "speculative.json", result)
    return result


if __name__ == "__main__":
    main()
