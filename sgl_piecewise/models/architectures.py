"""The architectures a checkpoint may name, for every loader: those with a
native model here, and those the transformers adapter runs."""

# Native models (``llama.py``, ``qwen2.py``; their classes by these names in
# ``hf_weights.MODEL_CLASSES``).
NATIVE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")

# Decoders whose transformers code runs unchanged through the adapter, each
# checked token for token against transformers' own generate in the tests:
# a config's ``model_type`` -> its causal LM class.
ADAPTER_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
}
ADAPTER_ARCHITECTURES = tuple(ADAPTER_MODEL_TYPES.values())

# What only the adapter runs, and every architecture a checkpoint may name.
ADAPTER_ONLY = tuple(a for a in ADAPTER_ARCHITECTURES if a not in NATIVE_ARCHITECTURES)
KNOWN_ARCHITECTURES = NATIVE_ARCHITECTURES + ADAPTER_ONLY
