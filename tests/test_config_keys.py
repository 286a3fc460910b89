"""The run config's keys, frozen: every dotted key of RunConfig (the YAML sections and the
command-line overrides users write) equals the list below, so renaming or removing a key, which
breaks users' configs and commands, is a deliberate change that shows in review."""

import dataclasses
import keyword
import typing

import pytest

from megarl.planning.config import LayoutConfig, RunConfig

KEYS = [
    "run_dir", "steps", "seed", "offload_params", "collective_timeout_s",
    "model.hf_dir", "model.megatron_dir", "model.router_fp32", "model.expert_bias_update_rate",
    "model.transformer_engine",
    "data.path", "data.prompt_key", "data.answer_key", "data.data_source_key", "data.extra_info_key",
    "data.max_prompt_len", "data.overlong_prompts",
    "data.prompts_per_step", "data.seed",
    "layout.world_size", "layout.tp", "layout.pp", "layout.cp", "layout.ep", "layout.etp", "layout.vpp",
    "layout.first_stage_layers", "layout.last_stage_layers",
    "layout.rollout_tp",
    "layout.rollout_ep", "layout.sync_bucket_mb", "layout.rollout_world_size", "layout.gpu_memory_gb",
    "generation.samples_per_prompt", "generation.temperature", "generation.top_p",
    "generation.max_new_tokens", "generation.producer", "generation.kv_cache_gib",
    "generation.agent.tools", "generation.agent.parser", "generation.agent.interaction",
    "generation.agent.max_turns", "generation.agent.max_tool_output_chars", "generation.agent.tool_timeout_s",
    "generation.agent.tool_workers", "generation.agent.sandbox", "generation.agent.sandbox_url",
    "generation.agent.sandbox_timeout_s", "generation.agent.sandbox_retries",
    "generation.gpu_memory_utilization", "generation.return_routing",
    "rollout.quantization",
    "algo.advantage", "algo.gamma", "algo.lam", "algo.eps", "algo.whiten_advantages", "algo.lone_groups",
    "algo.kl_reward_coeff", "algo.kl_estimator", "algo.kl_clamp", "algo.reward", "algo.reward_by_source",
    "algo.reward_workers", "algo.reward_timeout_s", "algo.overlong_buffer",
    "algo.overlong_penalty", "algo.dynamic_sampling_rounds", "algo.distill.coeff",
    "actor.policy_loss", "actor.eps_clip_low", "actor.eps_clip_high", "actor.dual_clip", "actor.aggregation",
    "actor.norm_tokens", "actor.entropy_coeff", "actor.kl_loss_coeff", "actor.kl_estimator", "actor.kl_clamp",
    "actor.rollout_correction.preset", "actor.rollout_correction.weights", "actor.rollout_correction.cap",
    "actor.rollout_correction.reject", "actor.rollout_correction.low", "actor.rollout_correction.high",
    "actor.router_aux_loss_coeff", "actor.router_replay",
    "actor.lora.rank", "actor.lora.alpha", "actor.lora.dropout", "actor.lora.targets", "actor.lora.rslora",
    "actor.lora.kind_ranks", "actor.lora.kind_alphas", "actor.lora.init",
    "actor.batching.mini_batch_size", "actor.batching.epochs", "actor.batching.micro_batch_tokens",
    "actor.batching.micro_batches", "actor.batching.shuffle_seed",
    "actor.optim.lr", "actor.optim.min_lr", "actor.optim.lr_warmup_steps", "actor.optim.lr_decay_steps",
    "actor.optim.lr_decay_style", "actor.optim.weight_decay", "actor.optim.adam_beta1",
    "actor.optim.adam_beta2", "actor.optim.adam_eps", "actor.optim.clip_grad",
    "actor.optim.use_distributed_optimizer",
    "actor.recompute.granularity", "actor.recompute.method", "actor.recompute.num_layers",
    "actor.recompute.modules", "actor.optimizer_offload.fraction", "actor.optimizer_offload.exp_avg_dtype",
    "actor.optimizer_offload.exp_avg_sq_dtype",
    "critic.value_clip", "critic.aggregation", "critic.norm_tokens",
    "critic.batching.mini_batch_size", "critic.batching.epochs", "critic.batching.micro_batch_tokens",
    "critic.batching.micro_batches", "critic.batching.shuffle_seed",
    "critic.optim.lr", "critic.optim.min_lr", "critic.optim.lr_warmup_steps", "critic.optim.lr_decay_steps",
    "critic.optim.lr_decay_style", "critic.optim.weight_decay", "critic.optim.adam_beta1",
    "critic.optim.adam_beta2", "critic.optim.adam_eps", "critic.optim.clip_grad",
    "critic.optim.use_distributed_optimizer",
    "critic.recompute.granularity", "critic.recompute.method", "critic.recompute.num_layers",
    "critic.recompute.modules", "critic.optimizer_offload.fraction", "critic.optimizer_offload.exp_avg_dtype",
    "critic.optimizer_offload.exp_avg_sq_dtype",
    "checkpoint.every", "checkpoint.keep", "checkpoint.export_hf", "checkpoint.export_dtype",
    "async.max_staleness", "async.partial_rollout", "async.max_engine_restarts",
    "eval.sets", "eval.every", "eval.at_start", "eval.samples", "eval.temperature", "eval.top_p",
    "eval.max_prompts", "eval.pass_k", "eval.threshold", "eval.max_new_tokens",
    "logger.trackers", "logger.project", "logger.name", "logger.mlflow_uri",
    "teacher.hf_dir", "teacher.url", "teacher.serve", "teacher.tp", "teacher.pp", "teacher.ep",
    "teacher.dtype", "teacher.offload", "teacher.timeout_s",
]


def dotted_keys(cls, prefix: str = ""):
    """The leaves of a frozen dataclass tree as dotted keys, as YAML spells them (a keyword's field
    `async_` is the key `async`); a section (a field whose type is a dataclass, Optional or not)
    contributes its own keys under its name."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        key = f.name[:-1] if keyword.iskeyword(f.name[:-1]) else f.name
        if typing.get_origin(kind) is typing.Union:
            inner = [a for a in typing.get_args(kind) if a is not type(None)]
            kind = inner[0] if len(inner) == 1 else kind
        if dataclasses.is_dataclass(kind):
            yield from dotted_keys(kind, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_config_keys_are_the_frozen_list():
    assert len(KEYS) == len(set(KEYS)), "KEYS lists a key twice"
    got = list(dotted_keys(RunConfig))
    added, removed = sorted(set(got) - set(KEYS)), sorted(set(KEYS) - set(got))
    assert not added and not removed, (
        f"RunConfig's keys changed: added {added}, removed or renamed {removed}. Users' YAML files and "
        "overrides name these keys: if the change is deliberate, update KEYS in tests/test_config_keys.py "
        "and docs/configuration.md (and configs/ where a preset sets a renamed key).")


def test_a_sync_bucket_below_one_mib_is_refused_naming_the_key():
    assert LayoutConfig(sync_bucket_mb=1024).sync_bucket_mb == 1024
    with pytest.raises(ValueError, match=r"layout.sync_bucket_mb=0 must be >= 1"):
        LayoutConfig(sync_bucket_mb=0)
