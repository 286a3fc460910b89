"""Shared fixtures, made once per session: tiny HF checkpoints of every family and variant, their
Megatron conversions (made with the user-facing converter script), and the demo's inputs."""

import os

import pytest

from tests.launch import run

# Every family, plus the variants that break naive code (tied embeddings, one KV head).
MODELS = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "llama_tied", "qwen2_gqa1"]
MOE_MODELS = ["qwen3_moe", "mixtral"]
# Converted with 2 ranks (each rank writes half the layers); the others with one process.
TWO_RANK_CONVERSION = {"qwen3_moe", "llama_tied", "qwen2"}


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    from megarl.demo.tiny_checkpoint import make_named

    root = tmp_path_factory.mktemp("hf")
    return {name: make_named(name, str(root / name)) for name in MODELS}


@pytest.fixture(scope="session")
def megatron_models(hf_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    out = {}
    for name, hf_dir in hf_models.items():
        out[name] = str(root / name)
        run("scripts/convert_hf_to_megatron.py", "--hf-dir", hf_dir, "--out", out[name],
            nproc=2 if name in TWO_RANK_CONVERSION else 1)
        assert os.path.isfile(os.path.join(out[name], "megarl_model.json"))
    return out


@pytest.fixture(scope="session")
def demo_inputs(tmp_path_factory):
    """The demo task's prompts (train.jsonl), model (model/) and its Megatron conversion (megatron/)."""
    root = tmp_path_factory.mktemp("demo_inputs")
    run("scripts/prepare_demo.py", "--out", str(root), "--prompts", "200")
    return root
