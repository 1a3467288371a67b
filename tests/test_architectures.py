"""One table of architecture names (``models/architectures.py``): the native
model classes, the config check, the GGUF names and the loader all follow it."""

from sgl_piecewise.models import architectures, gguf, hf_weights, loader, transformers_support


def test_every_native_architecture_has_its_model_class_and_no_other_class_is_listed():
    assert tuple(hf_weights.MODEL_CLASSES) == architectures.NATIVE_ARCHITECTURES


def test_gguf_files_load_only_as_native_architectures():
    assert set(gguf.GGUF_ARCHITECTURES.values()) <= set(architectures.NATIVE_ARCHITECTURES)


def test_the_loader_and_the_adapter_read_the_one_table():
    adapter_only = ("Mistral", "Qwen3", "Phi3", "Olmo2", "Granite", "SmolLM3")
    assert loader.ADAPTER_ONLY == tuple(f"{name}ForCausalLM" for name in adapter_only)
    assert architectures.KNOWN_ARCHITECTURES == architectures.NATIVE_ARCHITECTURES + loader.ADAPTER_ONLY
    assert transformers_support.ADAPTER_ARCHITECTURES is architectures.ADAPTER_ARCHITECTURES
