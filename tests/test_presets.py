"""The GPU cluster presets in configs/: each loads as a RunConfig, and its layout, rollout engines
and batch sizes fit the real model it is for, stood in by the model's published config.json (no
weights). The checks are the ones the run makes (ParallelDims, the TransformerConfig with its
check_model, rollout groups, mini-batches, micro-batch plans), applied before any GPU is asked."""

import json
import os

import pytest

from megarl.actor.config import BatchingConfig
from megarl.actor.packing import plan_micro_batches
from megarl.actor.passes import mini_batch_rows
from megarl.models.hf_config import ModelArch, load_arch
from megarl.models.megatron_config import transformer_config
from megarl.parallel_state.dims import ParallelDims
from megarl.rollout.vllm_engine import rollout_groups
from megarl.run_config import RunConfig
from megarl.typed_config import load
from tests.published_configs import MIXTRAL_8X7B, QWEN3_30B_A3B

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
PRESETS = {"qwen3_30b_a3b_gpu.yaml": QWEN3_30B_A3B, "mixtral_8x7b_gpu.yaml": MIXTRAL_8X7B}
GPUS_PER_NODE = 8  # the hardware the presets' headers name: nodes of 8 H100


def load_preset(name: str, tmp_path, *overrides: str):
    """(RunConfig, ModelArch) of a preset whose model and data paths point at stand-ins."""
    hf_dir = tmp_path / "model"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(PRESETS[name]))
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 1 =", "answer": "2"}) + "\n")
    config = load(RunConfig, os.path.join(CONFIGS, name),
                  [f"model.hf_dir={hf_dir}", f"data.path={data}", *overrides])
    return config, load_arch(str(hf_dir))


def _check_rollout(config: RunConfig, arch: ModelArch) -> None:
    """vLLM engines of rollout_tp GPUs inside one node, shards vLLM can make, prompts split evenly."""
    world, rollout_tp = config.layout.world_size, config.layout.rollout_tp
    engines = rollout_groups(world, rollout_tp)
    if GPUS_PER_NODE % rollout_tp:
        raise ValueError(f"layout.rollout_tp={rollout_tp} must divide the {GPUS_PER_NODE} GPUs of a "
                         "node: an engine's tensor-parallel all-reduces need NVLink")
    if arch.num_heads % rollout_tp or (arch.num_kv_heads % rollout_tp and rollout_tp % arch.num_kv_heads):
        raise ValueError(f"layout.rollout_tp={rollout_tp}: vLLM needs it to divide the {arch.num_heads} "
                         "attention heads and to divide or be a multiple of the "
                         f"{arch.num_kv_heads} KV heads")
    if arch.num_experts and arch.moe_ffn_hidden_size % rollout_tp:
        raise ValueError(f"layout.rollout_tp={rollout_tp} must divide moe_intermediate_size "
                         f"{arch.moe_ffn_hidden_size}: vLLM shards every expert over its TP ranks")
    if config.data.prompts_per_step % engines:
        raise ValueError(f"data.prompts_per_step={config.data.prompts_per_step} should be a multiple of "
                         f"the {engines} rollout engines (world {world} / rollout_tp {rollout_tp}), "
                         "or some engines wait for the others")


def _check_batching(batching: BatchingConfig, sequences: int, longest: int, dims: ParallelDims,
                    section: str) -> None:
    """Every pass over the step's sequences can be planned, even when all are the longest."""
    for rows in (sequences, len(mini_batch_rows(sequences, batching)[0])):  # log-probs, update
        try:
            plan_micro_batches([longest] * rows, dims.dp, batching.micro_batch_tokens,
                               batching.micro_batches, min_micro_batches=dims.pp if dims.vpp else 1)
        except ValueError as error:
            raise ValueError(f"{section}.batching with {rows} sequences over dp={dims.dp}: "
                             f"{error}") from error


def check_preset(config: RunConfig, arch: ModelArch) -> ParallelDims:
    """Raise ValueError naming the values if the preset cannot run the model on its cluster."""
    layout = config.layout
    dims = ParallelDims(world_size=layout.world_size, tp=layout.tp, pp=layout.pp, cp=layout.cp,
                        ep=layout.ep, etp=layout.etp, vpp=layout.vpp)
    transformer_config(arch, dims)  # check_model with the builder's arguments, then Megatron's checks
    if layout.world_size % GPUS_PER_NODE:
        raise ValueError(f"layout.world_size={layout.world_size} is not whole nodes of {GPUS_PER_NODE}")
    if GPUS_PER_NODE % dims.tp or GPUS_PER_NODE % (dims.ep * dims.expert_tp):
        raise ValueError(f"tp({dims.tp}) and ep({dims.ep}) * etp({dims.expert_tp}) must divide the "
                         f"{GPUS_PER_NODE} GPUs of a node: their collectives need NVLink")
    _check_rollout(config, arch)
    longest = config.data.max_prompt_len + config.generation.max_new_tokens
    if longest > arch.max_position_embeddings:
        raise ValueError(f"data.max_prompt_len + generation.max_new_tokens = {longest} exceeds the "
                         f"model's max_position_embeddings {arch.max_position_embeddings}")
    sequences = config.data.prompts_per_step * config.generation.samples_per_prompt
    _check_batching(config.actor.batching, sequences, longest, dims, "actor")
    if config.algo.uses_critic:
        _check_batching(config.critic.batching, sequences, longest, dims, "critic")
    return dims


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_fits_its_model(name, tmp_path):
    config, arch = load_preset(name, tmp_path)
    assert arch.architecture == PRESETS[name]["architectures"][0] and arch.num_experts
    dims = check_preset(config, arch)
    assert config.layout.world_size >= 2 * GPUS_PER_NODE, "a cluster preset spans nodes"
    assert dims.dp > 1, "data parallelism is what scales the batch"
    assert config.actor.optim.lr <= 1e-5, "RL fine-tuning of a pretrained model uses small rates"


QWEN, MIXTRAL = "qwen3_30b_a3b_gpu.yaml", "mixtral_8x7b_gpu.yaml"


@pytest.mark.parametrize("name,overrides,message", [
    (QWEN, ["layout.tp=3"], r"tp\(3\) \* pp\(2\) \* cp\(1\) \* dp\(\?\) must equal world size 32"),
    (QWEN, ["layout.tp=8"], r"num_key_value_heads\(4\) must be divisible by tp\(8\)"),
    (QWEN, ["layout.vpp=5"], r"num_layers\(48\) must be divisible by pp\(2\) \* vpp\(5\)"),
    (MIXTRAL, ["layout.pp=2", "layout.ep=16"], r"num_experts\(8\) must be divisible by ep\(16\)"),
    (MIXTRAL, ["layout.rollout_tp=3"], r"rollout tp 3 must divide the world size 64"),
    (MIXTRAL, ["layout.rollout_tp=16"], r"rollout_tp=16 must divide the 8 GPUs of a node"),
    (QWEN, ["actor.batching.mini_batch_size=100"], r"512 sequences is not divisible by mini_batch_size=100"),
    (QWEN, ["actor.batching.micro_batch_tokens=8192"], r"9216 tokens exceeds micro_batch_tokens=8192"),
    (MIXTRAL, ["critic.batching.mini_batch_size=4"], r"critic.batching with 4 sequences over dp=8"),
    (QWEN, ["generation.max_new_tokens=40000"], r"= 41024 exceeds the model.s max_position_embeddings 40960"),
])
def test_broken_override_is_refused_with_its_value(name, overrides, message, tmp_path):
    config, arch = load_preset(name, tmp_path, *overrides)
    with pytest.raises(ValueError, match=message):
        check_preset(config, arch)
