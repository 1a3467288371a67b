"""Loading GGUF files (``sgl_piecewise/models/gguf.py``), on tiny files written
here with ``gguf.GGUFWriter``: the config read from the metadata, the weights
(dequantised, Llama's Q/K rows put back), logits against the same weights
loaded from safetensors, and the error each broken file gets, naming it."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

gguf = pytest.importorskip("gguf", reason="GGUF loading needs the gguf package")

from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor  # noqa: E402

from sgl_piecewise.engine.testing import prefill_logits  # noqa: E402
from sgl_piecewise.errors import InvalidInputError  # noqa: E402
from sgl_piecewise.models import (  # noqa: E402
    Llama3RopeScaling,
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    load_gguf_model,
    load_model,
    load_model_or_default,
)
from sgl_piecewise.models.gguf import permute_qk, unpermute_qk  # noqa: E402
from sgl_piecewise.models.layers import rope_inv_freq  # noqa: E402

Q = gguf.GGMLQuantizationType

# Every width a multiple of 32, the block of the quantised types.
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
ROPE_THETA = 500000.0
HF_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama_bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"attention_bias": True}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
}
HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """``LlamaModel.permute`` of llama.cpp's convert_hf_to_gguf.py, as it is there."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in fixed:
        return fixed[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    return f"blk.{m.group(1)}.{HF_TO_GGUF[m.group(2)]}"


def hf_model(kind: str, seed: int = 0, **overrides):
    config_cls, model_cls, extra = HF_CLASSES[kind]
    config = config_cls(**{**TINY, **extra, **overrides}, rope_theta=ROPE_THETA)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a mix-up shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def hf_tensors(model) -> dict[str, np.ndarray]:
    tensors = {n: t.detach().numpy().copy() for n, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return tensors


def gguf_tensors(arch: str, hf: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
    """HF tensors as llama.cpp's convert script writes them: GGUF names, and
    for Llama the Q/K rows (weights and biases) permuted."""
    out = {}
    for name, w in hf.items():
        if arch == "llama" and re.search(r"\.(q|k)_proj\.", name):
            kv = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            w = llama_cpp_permute(w, config.num_attention_heads, kv)
        out[to_gguf_name(name)] = w
    return out


def write_gguf(
    path,
    arch: str,
    tensors: dict[str, np.ndarray],
    *,
    qtype=Q.F32,
    types: dict | None = None,
    drop_meta: tuple = (),
    meta: dict | None = None,
    head_dim: int = 16,
):
    """A GGUF file of ``tensors`` (torch-order numpy arrays): 2-D weights as
    ``qtype``, 1-D ones F32, ``types`` overriding per name (a numpy dtype
    such as float64 is written as it is)."""
    w = gguf.GGUFWriter(str(path), arch)
    values = {
        "block_count": TINY["num_hidden_layers"],
        "context_length": TINY["max_position_embeddings"],
        "embedding_length": TINY["hidden_size"],
        "feed_forward_length": TINY["intermediate_size"],
        "attention.head_count": TINY["num_attention_heads"],
        "attention.head_count_kv": TINY["num_key_value_heads"],
        "rope.dimension_count": head_dim,
    }
    values.update(meta or {})
    for key, value in values.items():
        if key not in drop_meta:
            w.add_uint32(f"{arch}.{key}", value)
    if "rope.freq_base" not in drop_meta:
        w.add_float32(f"{arch}.rope.freq_base", ROPE_THETA)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", TINY["rms_norm_eps"])
    for name, arr in tensors.items():
        t = (types or {}).get(name, qtype if arr.ndim == 2 else Q.F32)
        if isinstance(t, Q):
            w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), t), raw_dtype=t)
        else:
            w.add_tensor(name, arr.astype(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def save_safetensors_checkpoint(path, kind: str, tensors: dict[str, np.ndarray], config) -> None:
    path.mkdir()
    architectures = [HF_CLASSES[kind][1].__name__]
    (path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": architectures}))
    save_file({n: torch.from_numpy(np.ascontiguousarray(t)) for n, t in tensors.items()}, path / "model.safetensors")


def _arch(kind: str) -> str:
    return "qwen2" if kind == "qwen2" else "llama"


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    """A tiny untied Llama as F32 GGUF, with the HF model it came from."""
    hf = hf_model("llama")
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_gguf(path, "llama", gguf_tensors("llama", hf_tensors(hf), hf.config))
    return path, hf


def _rewrite(tmp_path, name="broken.gguf", kind="llama", edit=None, **kwargs):
    """A fresh tiny file, its tensors edited (``edit(dict)``) first."""
    hf = hf_model(kind)
    tensors = gguf_tensors(_arch(kind), hf_tensors(hf), hf.config)
    if edit is not None:
        edit(tensors)
    return write_gguf(tmp_path / name, _arch(kind), tensors, **kwargs)


# ---- the permutation ---------------------------------------------------------


def test_permutation_pairs_rotate_half_dims_into_adjacent_rows_and_is_undone():
    head_dim, n_head = 8, 2
    rows = np.arange(n_head * head_dim, dtype=np.float32)[:, None]  # row r holds r
    permuted = permute_qk(rows, n_head)[:, 0].astype(int).tolist()
    # In each head, HF rotates dim j with j + 4; llama.cpp rotates 2j with 2j + 1.
    assert permuted == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    w = np.random.default_rng(0).standard_normal((n_head * head_dim, 5)).astype(np.float32)
    assert np.array_equal(permute_qk(w, n_head), llama_cpp_permute(w, n_head))
    assert np.array_equal(unpermute_qk(llama_cpp_permute(w, n_head), n_head), w)
    # transformers undoes it the same way when it loads a Llama GGUF.
    undone = LlamaTensorProcessor()._reverse_permute_weights(llama_cpp_permute(w, n_head), n_head, n_head)
    assert np.array_equal(undone, w)


def test_permuted_rows_under_interleaved_rotary_equal_hf_rotary_permuted():
    """Why the rows move: llama.cpp's rotary (adjacent pairs) on permuted q
    gives the permutation of HF's rotary (rotate_half) on q."""
    head_dim, theta, pos = 16, 10000.0, 7.0
    q = torch.randn(head_dim, dtype=torch.float64)
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    cos, sin = (pos * inv).cos(), (pos * inv).sin()
    x1, x2 = q[: head_dim // 2], q[head_dim // 2 :]
    hf = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])
    p = torch.from_numpy(permute_qk(q.numpy()[:, None], 1)[:, 0])
    even, odd = p[0::2], p[1::2]
    ggml = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).reshape(-1)
    assert torch.allclose(ggml, torch.from_numpy(permute_qk(hf.numpy()[:, None], 1)[:, 0]))


# ---- loading -------------------------------------------------------------------


def test_reader_sees_the_same_fields_and_tensors_as_gguf_own_reader(llama_file):
    from sgl_piecewise.models.gguf import open_gguf

    path, _ = llama_file
    ours, stock = open_gguf(str(path)), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(stock.fields)
    assert all(ours.fields[k].contents() == stock.fields[k].contents() for k in stock.fields)
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist()) for t in stock.tensors
    ]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, stock.tensors))


def test_llama_config_is_read_from_the_metadata(llama_file):
    path, hf = llama_file
    model = load_model(path)
    c = model.config
    assert isinstance(model, LlamaForCausalLM)
    assert c.architecture == "LlamaForCausalLM"
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (64, 96, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (4, 2, 16, 128)
    assert c.max_position_embeddings == 64 and c.rope_theta == ROPE_THETA and c.rms_norm_eps == 1e-5
    assert not c.tie_word_embeddings and not c.qkv_bias and c.rope_scaling is None


def test_f32_llama_weights_are_the_hf_weights_with_q_and_k_unpermuted(llama_file):
    path, hf = llama_file
    model = load_gguf_model(path)
    sd = hf.state_dict()
    for i in range(2):
        p = f"model.layers.{i}."
        want_qkv = torch.cat([sd[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(model.model.layers[i].self_attn.qkv_proj.weight, want_qkv)
        want_gate_up = torch.cat([sd[f"{p}mlp.gate_proj.weight"], sd[f"{p}mlp.up_proj.weight"]])
        assert torch.equal(model.model.layers[i].mlp.gate_up_proj.weight, want_gate_up)
        assert torch.equal(model.model.layers[i].input_layernorm.weight, sd[f"{p}input_layernorm.weight"])
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])
    assert torch.equal(model.model.norm.weight, sd["model.norm.weight"])


@pytest.mark.parametrize("kind", ["llama", "llama_bias", "qwen2"])
def test_f32_logits_equal_the_same_weights_loaded_from_safetensors(kind, tmp_path):
    hf = hf_model(kind, seed=3)
    tensors = hf_tensors(hf)
    gguf_path = write_gguf(tmp_path / "m.gguf", _arch(kind), gguf_tensors(_arch(kind), tensors, hf.config))
    save_safetensors_checkpoint(tmp_path / "st", kind, tensors, hf.config)
    ours, ref = load_model(gguf_path), load_model(tmp_path / "st")
    assert type(ours) is type(ref) and ours.config == ref.config
    pa, pb = dict(ours.named_parameters()), dict(ref.named_parameters())
    assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)
    prompt = [3, 17, 99, 5, 64, 127, 0, 42]
    assert torch.equal(prefill_logits(ours, prompt), prefill_logits(ref, prompt))
    if kind == "qwen2":
        assert isinstance(ours, Qwen2ForCausalLM) and ours.config.tie_word_embeddings
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    if kind == "llama_bias":
        assert ours.config.qkv_bias and ours.config.o_proj_bias


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_1, Q.F16, Q.BF16])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_quantised_weights_are_the_dequantised_originals(kind, qtype, tmp_path):
    hf = hf_model(kind, seed=5)
    arch = _arch(kind)
    tensors = gguf_tensors(arch, hf_tensors(hf), hf.config)
    path = write_gguf(tmp_path / "q.gguf", arch, tensors, qtype=qtype)
    model = load_model(path)
    # What the file holds, dequantised by gguf, Q/K rows undone by transformers' code.
    heads = {"attn_q": (4, 4), "attn_k": (4, 2)}
    dequantised = {}
    for name, w in tensors.items():
        d = gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), qtype), qtype) if w.ndim == 2 else w
        kind_ = name.split(".")[-2]
        if arch == "llama" and kind_ in heads:
            d = LlamaTensorProcessor()._reverse_permute_weights(d, *heads[kind_])
        dequantised[name] = torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32))
    if qtype != Q.F16:  # the quantisation is lossy: the check below would catch a missed dequantise
        assert not torch.equal(dequantised["blk.0.attn_q.weight"], torch.from_numpy(hf_tensors(hf)[
            "model.layers.0.self_attn.q_proj.weight"]))  # fmt: skip
    for i in range(2):
        attn = model.model.layers[i].self_attn
        want = torch.cat([dequantised[f"blk.{i}.attn_{x}.weight"] for x in "qkv"])
        assert torch.equal(attn.qkv_proj.weight, want)
        assert torch.equal(attn.o_proj.weight, dequantised[f"blk.{i}.attn_output.weight"])
        assert torch.equal(model.model.layers[i].mlp.down_proj.weight, dequantised[f"blk.{i}.ffn_down.weight"])
        if kind == "qwen2":
            want_bias = torch.cat([dequantised[f"blk.{i}.attn_{x}.bias"] for x in "qkv"])
            assert torch.equal(attn.qkv_proj.bias, want_bias)
    assert torch.equal(model.model.embed_tokens.weight, dequantised["token_embd.weight"])


def test_quantised_logits_equal_the_dequantised_weights_saved_as_safetensors(tmp_path):
    hf = hf_model("llama", seed=6)
    tensors = hf_tensors(hf)
    path = write_gguf(tmp_path / "q8.gguf", "llama", gguf_tensors("llama", tensors, hf.config), qtype=Q.Q8_0)
    ours = load_model(path)
    # The dequantised weights, back in HF names and order, as a safetensors checkpoint.
    back = {}
    for name, w in tensors.items():
        back[name] = gguf.quants.dequantize(gguf.quants.quantize(w, Q.Q8_0), Q.Q8_0) if w.ndim == 2 else w
    save_safetensors_checkpoint(tmp_path / "st", "llama", back, hf.config)
    ref = load_model(tmp_path / "st")
    prompt = [1, 2, 3, 100, 50, 7]
    assert torch.equal(prefill_logits(ours, prompt), prefill_logits(ref, prompt))


def test_requested_dtype_is_reached_through_float32(llama_file):
    path, hf = llama_file
    model = load_model(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    want = hf.state_dict()["model.layers.1.self_attn.v_proj.weight"].to(torch.bfloat16)
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight[-32:], want)


def test_directory_with_one_gguf_file_loads_it_and_load_model_or_default_takes_a_file(llama_file, tmp_path):
    path, _ = llama_file
    (tmp_path / "model.gguf").write_bytes(path.read_bytes())
    a, b = load_model(tmp_path), load_model_or_default(path)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_directory_with_two_gguf_files_is_refused_naming_them(llama_file, tmp_path):
    path, _ = llama_file
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(path.read_bytes())
    with pytest.raises(InvalidInputError, match=r"expected at most one \.gguf file .*\['a\.gguf', 'b\.gguf'\]"):
        load_model(tmp_path)


def test_llama3_rope_scaling_is_read_back_from_rope_freqs(tmp_path):
    scaling = Llama3RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192)  # fmt: skip
    # llama.cpp's rope_freqs: each frequency's divisor; here from our own (HF-matched) rotary code.
    divisors = rope_inv_freq(16, ROPE_THETA, None) / rope_inv_freq(16, ROPE_THETA, scaling)
    assert len(set(np.round(divisors.numpy(), 3).tolist())) > 2  # unscaled, scaled and smoothed ones

    def add_freqs(t):
        t["rope_freqs.weight"] = divisors.numpy()

    model = load_model(_rewrite(tmp_path, edit=add_freqs))
    assert model.config.rope_scaling == scaling

    def bad_freqs(t):
        t["rope_freqs.weight"] = divisors.numpy() * np.linspace(1, 2, 8, dtype=np.float32)

    with pytest.raises(InvalidInputError, match=r"bad\.gguf at .*rope_freqs\.weight: expected Llama 3 rotary"):
        load_model(_rewrite(tmp_path, "bad.gguf", edit=bad_freqs))


# ---- bad files: each refused naming the file and what was expected ---------------


def _refused(path, pattern: str):
    with pytest.raises(InvalidInputError) as info:
        load_model(path)
    message = str(info.value)
    assert f"{path.name} at {path}" in message, message
    assert re.search(pattern, message), message
    return message


def test_another_architecture_is_refused(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_uint32("gpt2.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _refused(path, r"general\.architecture: expected one of llama, qwen2, got 'gpt2'")


def test_tensor_type_the_dequantiser_does_not_support_is_refused(tmp_path):
    assert Q.F64 not in gguf.quants._type_traits  # what makes it a fair example
    path = _rewrite(tmp_path, types={"blk.1.attn_norm.weight": np.float64})
    _refused(path, r"expected tensor types gguf's dequantiser supports \(F32, F16, Q4_0, .*\), "
                   r"got \[blk\.1\.attn_norm\.weight \(F64\)\]")  # fmt: skip


@pytest.mark.parametrize("keep", [0.5, 0.02, 0.9])
def test_truncated_file_is_refused(llama_file, tmp_path, keep):
    path, _ = llama_file
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    _refused(cut, r"expected a complete GGUF file, .*: truncated or not a GGUF file")


@pytest.mark.parametrize("content", [b"", b"GG", b'{"not": "gguf"}' * 10])
def test_file_that_is_not_gguf_is_refused(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    _refused(path, r"expected a GGUF file \(starting with b'GGUF'\), got .*: not a GGUF file")


def test_safetensors_file_passed_as_a_file_is_refused_as_not_gguf(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"x": torch.zeros(2)}, path)
    _refused(path, r"not a GGUF file; a checkpoint is a Hugging Face checkpoint directory or a \.gguf file")


def test_missing_tensor_is_named(tmp_path):
    path = _rewrite(tmp_path, edit=lambda t: t.pop("blk.1.ffn_up.weight"))
    _refused(path, r"expected exactly the tensors its metadata implies for LlamaForCausalLM, "
                   r"got missing \[blk\.1\.ffn_up\.weight\]$")  # fmt: skip


def test_unexpected_tensor_is_named(tmp_path):
    path = _rewrite(tmp_path, edit=lambda t: t.update({"blk.0.ffn_gate_exps.weight": np.zeros((4, 64))}))
    _refused(path, r"got unexpected \[blk\.0\.ffn_gate_exps\.weight\]$")


def test_tensor_of_the_wrong_shape_is_named_with_both_shapes(tmp_path):
    path = _rewrite(tmp_path, edit=lambda t: t.update({"blk.0.attn_k.weight": np.zeros((16, 64), np.float32)}))
    _refused(path, r"blk\.0\.attn_k\.weight \(model\.layers\.0\.self_attn\.k_proj\.weight\): "
                   r"expected shape \[32, 64\], got \[16, 64\] \(the file's ggml order: \[64, 16\]\)")  # fmt: skip


def test_missing_metadata_is_named(tmp_path):
    path = _rewrite(tmp_path, drop_meta=("block_count",))
    _refused(path, r"expected metadata keys \['llama\.block_count'\], got none of them")


def test_inconsistent_metadata_goes_through_the_config_checks(tmp_path):
    path = _rewrite(tmp_path, meta={"attention.head_count_kv": 3})
    _refused(path, r"GGUF metadata as a Hugging Face config: num_key_value_heads: expected a divisor")


def test_mixture_of_experts_llama_is_refused(tmp_path):
    path = _rewrite(tmp_path, meta={"expert_count": 8})
    _refused(path, r"llama\.expert_count: expected 0 \(no mixture of experts\), got 8")
