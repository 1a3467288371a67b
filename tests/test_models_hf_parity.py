"""Our Llama and Qwen2 against Hugging Face ``transformers``, the real thing.

A small random HF model is saved with ``save_pretrained`` (safetensors) and
loaded with ``sgl_piecewise.models.load_model``. Then:

* logits of a ragged prefill of three prompts (one batch, paged KV, the
  reference attention backend) equal HF's logits for each prompt run alone;
* greedy tokens of ``ModelRunner.generate`` (one EXTEND step, then DECODE
  steps over the paged cache) equal HF ``generate(do_sample=False)``.

Tolerance: float32 throughout, ``atol = rtol = 1e-4`` on logits of magnitude
~1. The two implementations compute the same function with a different
summation order (fused q/k/v and gate/up matmuls, SDPA instead of an explicit
softmax, a ragged batch instead of one prompt), which moves float32 results
by a few ulps per op, ~1e-6 after the whole model; 1e-4 leaves room for that
and still catches any real mistake (a wrong rotary angle, a missing bias, a
wrong mask or head mapping each move logits by ~1e-2 or more).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from sgl_piecewise.backends import ReferenceBackend
from sgl_piecewise.context import forward_context
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.engine.testing import place_requests
from sgl_piecewise.forward import ForwardBatch, ForwardMode
from sgl_piecewise.memory import KVPool, ReqToTokenPool
from sgl_piecewise.models import load_model

ATOL = RTOL = 1e-4
PROMPT_LENS = (9, 1, 14)  # ragged, one single-token prompt among them
NEW_TOKENS = 20
VOCAB = 160

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    # No special tokens: HF generate must not stop early at a random EOS.
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    # HF's plain matmul-softmax attention: the most literal reference.
    attn_implementation="eager",
)


def _llama_config() -> transformers.LlamaConfig:
    # original_max_position_embeddings=16 puts the llama3 scaling's smoothed
    # band inside head_dim 16's wavelengths, so every branch of it is used.
    scaling = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    )
    return transformers.LlamaConfig(**COMMON, rope_theta=500000.0, rope_scaling=scaling)


def _qwen2_config() -> transformers.Qwen2Config:
    return transformers.Qwen2Config(**COMMON, rope_theta=10000.0, tie_word_embeddings=True)


def _llama_attention_bias_config() -> transformers.LlamaConfig:
    # attention_bias gives q, k, v *and* o_proj a bias in transformers' Llama.
    return transformers.LlamaConfig(**COMMON, rope_theta=10000.0, attention_bias=True)


FAMILIES = {
    "llama": (transformers.LlamaForCausalLM, _llama_config),
    "llama-attention-bias": (transformers.LlamaForCausalLM, _llama_attention_bias_config),
    "qwen2": (transformers.Qwen2ForCausalLM, _qwen2_config),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Spread weights wider than HF's init (std 0.02, zero bias, unit norms) so
    every parameter matters and greedy argmax is far from ties."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_and_dir(request, tmp_path_factory):
    """``(hf_model, checkpoint_dir)`` for each family, saved once per module."""
    cls, make_config = FAMILIES[request.param]
    hf = cls(make_config()).eval()
    assert hf.config._attn_implementation == "eager"
    _randomize(hf, seed=1234)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def test_ragged_prefill_logits_match_hf_run_per_prompt(hf_and_dir):
    hf, path = hf_and_dir
    model = load_model(path)
    cfg = model.config
    prompts = _prompts(seed=7)
    req_pool = ReqToTokenPool(max_reqs=4, max_context_len=64)
    kv_pool = KVPool(256, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    backend = ReferenceBackend(req_pool, kv_pool)
    lens = [len(p) for p in prompts]
    rows, loc = place_requests(req_pool, kv_pool, [0] * 3, lens, fill_prefix=False)
    ids = torch.tensor([t for p in prompts for t in p])
    batch = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, [0] * 3, lens, loc)
    backend.init_forward_metadata(batch)
    with torch.no_grad(), forward_context(batch, backend):
        ours = model.compute_logits(model(batch.input_ids, batch.positions))  # [T, vocab]

    assert ours.dtype == torch.float32 and ours.shape == (sum(lens), VOCAB)
    start = 0
    for prompt in prompts:
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].float()  # [len, vocab]
        got = ours[start : start + len(prompt)]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        start += len(prompt)


def test_greedy_generate_matches_hf_generate_token_for_token(hf_and_dir):
    hf, path = hf_and_dir
    runner = ModelRunner(load_model(path), max_reqs=4, max_context_len=64)
    prompts = _prompts(seed=8)

    got = runner.generate(prompts, max_new_tokens=NEW_TOKENS)

    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert tokens == out[0, len(prompt) :].tolist()


# ---- on a CUDA GPU ---------------------------------------------------------
# bf16 tolerance: bf16 keeps 8 bits of mantissa (relative step 2^-8 ~ 4e-3);
# through two layers of matmuls with different summation orders (HF's
# attention vs ours) logits of magnitude ~1-3 move by a few of those steps.
# 5e-2 absolute covers that with room while a real bug (wrong rope, bias,
# mask) moves logits by ~1e-1 or more (see the CPU tolerance note above).
BF16_ATOL = 5e-2


@pytest.mark.gpu
def test_greedy_tokens_match_hf_on_cuda_in_float32(hf_and_dir):
    hf, path = hf_and_dir
    hf_cuda = hf.to("cuda")
    runner = ModelRunner(load_model(path, device="cuda"), max_reqs=4, max_context_len=64)
    prompts = _prompts(seed=9)
    got = runner.generate(prompts, max_new_tokens=NEW_TOKENS)
    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            out = hf_cuda.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert tokens == out[0, len(prompt) :].tolist()
    hf.to("cpu")


@pytest.mark.gpu
def test_bf16_logits_match_hf_on_cuda_within_tolerance(hf_and_dir):
    hf, path = hf_and_dir
    hf_bf16 = type(hf)(hf.config).to("cuda", torch.bfloat16).eval()
    hf_bf16.load_state_dict(hf.state_dict())
    model = load_model(path, dtype=torch.bfloat16, device="cuda")
    cfg = model.config
    prompts = _prompts(seed=10)
    lens = [len(p) for p in prompts]
    req_pool = ReqToTokenPool(max_reqs=4, max_context_len=64, device="cuda")
    kv_pool = KVPool(256, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16, "cuda")
    backend = ReferenceBackend(req_pool, kv_pool)
    rows, loc = place_requests(req_pool, kv_pool, [0] * 3, lens, fill_prefix=False)
    ids = torch.tensor([t for p in prompts for t in p], device="cuda")
    batch = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, [0] * 3, lens, loc)
    backend.init_forward_metadata(batch)
    with torch.no_grad(), forward_context(batch, backend):
        ours = model.compute_logits(model(batch.input_ids, batch.positions))
    start = 0
    for prompt in prompts:
        with torch.no_grad():
            want = hf_bf16(torch.tensor([prompt], device="cuda")).logits[0].float()
        torch.testing.assert_close(ours[start : start + len(prompt)], want, atol=BF16_ATOL, rtol=0)
        start += len(prompt)
