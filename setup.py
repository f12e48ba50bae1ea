"""megatron_fastpath: sync-free glue around Megatron-Core's math kernels."""

from setuptools import find_packages, setup

setup(
    name="megatron_fastpath",
    version="0.9.0",
    description=(
        "Packed-sequence params cache, TE-aware double-buffered activation offload and a "
        "sort/count MoE token dispatcher for Megatron-Core, free of CPU-GPU syncs."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_fastpath", "megatron_fastpath.*"]),
    # the main job's Hydra configs: a non-editable install (a wheel) runs the main job too
    package_data={"megatron_fastpath": ["configs/*.yaml", "configs/*/*.yaml"]},
    install_requires=[
        "torch>=2.6",
        # the release lines megatron_fastpath.compat is checked against: 0.16.x and 0.19.x
        # (CHECKED_MCORE_LINES; 0.17 / 0.18 install but the shims refuse them)
        "megatron-core>=0.16.1,<0.20",
        "hydra-core>=1.3.2,<1.4",
        "omegaconf",
        "numpy",
    ],
    extras_require={
        # GPU-only packages: they do not install or run on CPU machines.
        # megatron-core 0.16.1's own range (its "dev" extra; 0.19.x's "te" extra has none and
        # gates newer TE features at run time); >= 2.3 is needed at least for
        # transformer_engine.pytorch.attention.rope (the te backend's fused RoPE).
        "te": ["transformer-engine[pytorch]>=2.9.0a0,<2.12.0"],
        "flash": ["flash-attn>=2.6"],
        # NeMo 2 recipes (nemo.collections.llm) live in 2.x; 3.0 dropped them.
        "nemo": [
            "nemo-toolkit[llm]>=2.7,<2.8",
            "nemo_run==0.11.*",
            "pyarrow==21.*",
            "leptonai==0.26.*",
        ],
        # model=hf / data=jsonl at run time (no transformers needed) + metrics backends.
        "hf": [
            "safetensors>=0.4.3",
            "tokenizers>=0.22,<0.23",
            "jinja2>=3.1",
            "tqdm>=4.66",
            "tensorboard>=2.15",
            "matplotlib>=3.8",
            "wandb>=0.19,<0.32",
            # data.path of Parquet / Arrow / JSON arrays / save_to_disk (JSONL needs nothing);
            # NeMo 2.7 takes any datasets, nvidia-modelopt (its dependency) >= 3.0; 5.x installs with it
            "datasets>=3.0,<6",
        ],
        # Reference implementations for the parity tests and the example checkpoint builder;
        # pins co-install with the nemo extra (NeMo 2.7 brings transformers 4.57, peft 0.21).
        "hf-test": ["transformers>=4.57,<4.58", "peft>=0.21,<0.22"],
        "test": [
            "pytest>=8",
            "safetensors>=0.4.3",
            "tokenizers>=0.22,<0.23",
            "jinja2>=3.1",
            "tqdm>=4.66",
            "tensorboard>=2.15",
            "matplotlib>=3.8",
            "wandb>=0.19,<0.32",
            "transformers>=4.57,<4.58",
            "peft>=0.21,<0.22",
            "datasets>=3.0,<6",
        ],
    },
    entry_points={"console_scripts": ["megatron-fastpath-train=megatron_fastpath.train:main"]},
)
