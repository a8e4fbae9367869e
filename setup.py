"""megatron_kd: knowledge distillation for Megatron-Core at pretraining scale."""

from setuptools import find_packages, setup

setup(
    name="megatron_kd",
    version="0.1.0",
    description=(
        "Knowledge distillation for Megatron-Core: a fused vocab-parallel KD loss, an offline "
        "top-K teacher cache, a disaggregated teacher and a memory/traffic planner."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_kd", "megatron_kd.*"]),
    include_package_data=True,
    # Everything import-hf, export-hf and preprocess import on their way (tests/unit/
    # test_install_requires.py reads the source and holds this list to it): tokenizers for the
    # tokenizer.json they read and write, safetensors for Hugging Face weights.
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16",
        "numpy",
        "tokenizers",
        "safetensors",
    ],
    extras_require={
        # What the test suite needs beyond the core (tokenizer and HF import parity tests).
        # atheris: the coverage-guided fuzzer of the decoders (tests/unit/test_fuzz.py).
        # tensorboard, wandb: the metrics tests read back event files and an offline W&B run.
        # pytest-xdist: the test command runs the test modules on every core (-n auto, a module
        # per worker: tests/conftest.py sizes the workers to the machine's cores and memory).
        # triton: the fused loss's kernels, tested on the CPU through Triton's interpreter (the
        # version torch 2.13's CUDA build pins; the CPU build ships none).
        "test": ["pytest>=7", "pytest-xdist>=3.5", "tokenizers", "safetensors",
                 "transformers>=4.56", "matplotlib", "gguf", "atheris", "tensorboard", "wandb",
                 'triton==3.7.1; platform_system == "Linux" and platform_machine == "x86_64"'],
        # TensorBoard and W&B (--tensorboard-dir, --wandb-project) and megatron-kd report's plots.
        "metrics": ["tensorboard", "wandb", "matplotlib"],
        # Transformer Engine layer specs: GPU only, never imported unguarded.
        "te": ["transformer-engine[pytorch]"],
        # Peers for benchmarks: ModelOpt's LogitsKLLoss (Megatron-LM's KD loss) and the
        # dependencies ModelOpt imports without declaring them; Liger-Kernel's fused-linear
        # distillation losses (on a CPU-only machine install it with --no-deps: its chunked
        # losses need no Triton).
        "peers": ["nvidia-modelopt", "requests", "huggingface_hub", "liger-kernel"],
        # The CPU demo: loading a GGUF teacher through transformers.
        "demo": ["transformers>=4.56", "gguf", "accelerate", "tokenizers", "safetensors",
                 "matplotlib"],
    },
    entry_points={"console_scripts": ["megatron-kd = megatron_kd.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
