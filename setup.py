"""megatron_fastpath: sync-free glue around Megatron-Core's math kernels."""

from setuptools import find_packages, setup

setup(
    name="megatron_fastpath",
    version="0.12.0",
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
        # Megatron-Bridge 0.6 recipes + finetune path (Python 3.12, megatron-core 0.19.x), CPU
        # machines: megatron-bridge itself goes in with --no-deps (its own requirements pull
        # flashinfer, TE, mlflow, comet-ml, timm, ...); these are what `import megatron.bridge`,
        # megatron.bridge.training.finetune / gpt_step and megatron.bridge.recipes import at
        # module level (file:line of the first import of each, Bridge 0.6.2). Bridge also
        # imports transformer_engine unconditionally (peft/lora_layers.py:20): on a CPU machine
        # only the tests' fake TE stands in. Conflicts with "test" / "hf-test" (transformers 4.57):
        # its own venv (CI: .venv-bridge, a copy of the primary venv; docs/integrations.md).
        "bridge": [
            "transformers>=5.8,<=5.12.1",  # Bridge's pin; models/*/..._bridge.py (package __init__)
            "omegaconf>=2.3",  # models/config.py:22
            "hydra-core>=1.3.4,<1.4",  # Bridge's pin; training/utils/omegaconf_utils
            "einops", "six>=1.17", "rich",  # installed with the above, from Bridge's list
            "datasets>=3.0,<6",  # data/datasets/gpt_sft.py:23
            "megatron-energon>=7,<8",  # data/energon/base_energon_datamodule.py:19 (data/builders)
            "tensorboard>=2.19",  # torch.utils.tensorboard via the training logger
            "wandb==0.29.0",  # Bridge's pin
            "nvidia-modelopt>=0.40,<0.50",  # training/checkpointing.py:56, gpt_step.py:19
            # training/pretrain.py:19 (inprocess.CallWrapper); megatron-core 0.19.2 refuses < 0.6
            # once it is installed (dist_checkpointing/strategies/nvrx.py:85 reads __version__,
            # NVRX_MIN_VERSION 0.6.0); >= 0.5 ships manylinux_2_39 wheels only (glibc >= 2.39)
            "nvidia-resiliency-ext>=0.6,<0.8",
            "psutil", "pydantic>=2", "nvidia-ml-py",  # nvidia-resiliency-ext's imports
            "diffusers>=0.36",  # diffusion/conversion/flux/flux_bridge.py:18 (package __init__)
            "accelerate", "peft>=0.18.1",  # Bridge's list (installed together with diffusers)
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
