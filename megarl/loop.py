"""The RL loop of the 3D hybrid engine, one step per iteration, as in DESIGN.md's diagram:
generate -> reward -> old/ref log-probs, values -> advantages -> actor/critic update -> sync.

Every rank runs `train` (SPMD): the processes come from torchrun or from Ray (megarl/launch.py).
Each phase is one named call, timed under its name. Does not compute anything itself.
"""

import json
import os
from dataclasses import asdict

import torch

from megarl.actor.actor import Actor
from megarl.algos.advantages import ADVANTAGE_ESTIMATORS
from megarl.algos.kl import KL_ESTIMATORS
from megarl.algos.shaping import overlong_penalty
from megarl.critic.critic import Critic
from megarl.models import checkpoint
from megarl.models.builder import build_model
from megarl.models.hf_config import arch_from_hf_config
from megarl.models.hf_io import load_hf_weights
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims
from megarl.resharding.sync import sync_weights
from megarl.rollout.collect import collect
from megarl.rollout.engine import SamplingConfig
from megarl.rollout.prompts import PromptSampler, load_prompts
from megarl.rollout.rewards import load_reward_fn
from megarl.rollout.vllm_engine import VLLMEngine
from megarl.run_config import AlgoConfig, RunConfig
from megarl.run_metrics import MetricsLog, PhaseTimer
from megarl.run_plots import plot_run


def with_advantages(batch, algo: AlgoConfig, max_new_tokens: int):
    """Token rewards (sequence reward on the last response token, DAPO overlong shaping, KL
    penalty) -> the configured estimator's advantages and returns."""
    mask = batch.loss_mask
    last = (mask * torch.arange(batch.width)).argmax(1)  # [N] last response token
    seq_rewards = batch.rewards.clone()
    if algo.overlong_buffer:
        seq_rewards += overlong_penalty(mask.sum(1), max_new_tokens, algo.overlong_buffer,
                                        algo.overlong_penalty)
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(batch.size), last] = seq_rewards
    if algo.kl_reward_coeff:
        kl = KL_ESTIMATORS[algo.kl_estimator](batch.old_logprobs, batch.ref_logprobs) * mask
        token_rewards = token_rewards - algo.kl_reward_coeff * kl
    advantages, returns = ADVANTAGE_ESTIMATORS[algo.advantage](
        token_rewards=token_rewards, seq_rewards=seq_rewards, values=batch.values, mask=mask,
        group_ids=batch.group_ids, gamma=algo.gamma, lam=algo.lam, eps=algo.eps)
    return batch.with_fields(advantages=advantages, returns=returns)


def _load(chunks, arch, config: RunConfig, role: str) -> None:
    if role == "policy" and config.model.megatron_dir:
        checkpoint.load(chunks, config.model.megatron_dir)
    else:
        load_hf_weights(chunks, arch, config.model.hf_dir, role=role)


def _rollout_mismatch(batch) -> dict:
    mask = batch.loss_mask.bool()
    diff = (batch.old_logprobs - batch.rollout_logprobs)[mask].abs()
    return {"rollout/logprob_diff_mean": float(diff.mean()), "rollout/logprob_diff_max": float(diff.max())}


def train(config: RunConfig) -> dict:
    """Run config.steps steps; returns the last step's metrics. Collective."""
    import transformers

    layout = config.layout
    world = megatron_groups.init_distributed()
    if world != layout.world_size:
        raise ValueError(f"layout.world_size={layout.world_size} but {world} processes were started; "
                         "make them agree (torchrun --nproc-per-node, or let Ray place the workers)")
    dims = ParallelDims(world_size=world, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                        etp=layout.etp, vpp=layout.vpp)
    with open(os.path.join(config.model.hf_dir, "config.json")) as f:
        arch = arch_from_hf_config(json.load(f))
    megatron_groups.initialize(dims, seed=config.seed)
    rank0 = megatron_groups.is_rank0()
    if rank0:
        os.makedirs(config.run_dir, exist_ok=True)
        with open(os.path.join(config.run_dir, "config.json"), "w") as f:
            json.dump(asdict(config), f, indent=2)

    actor_chunks = build_model(arch, dims, perform_initialization=False)
    _load(actor_chunks, arch, config, "policy")
    actor = Actor(actor_chunks, arch, config.actor)
    if config.actor.kl_loss_coeff or config.algo.kl_reward_coeff:
        actor.snapshot_reference()
    critic = None
    if config.algo.uses_critic:
        critic_chunks = build_model(arch, dims, role="value")
        _load(critic_chunks, arch, config, "value")
        critic = Critic(critic_chunks, config.critic)

    tokenizer = transformers.AutoTokenizer.from_pretrained(config.model.hf_dir)
    prompts = load_prompts(config.data.path, tokenizer, config.data.max_prompt_len,
                           config.data.prompt_key, config.data.answer_key)
    sampler = PromptSampler(len(prompts.prompts), config.data.prompts_per_step, config.data.seed)
    reward_fn = load_reward_fn(config.algo.reward)
    gen = config.generation
    engine = VLLMEngine(config.model.hf_dir, rollout_tp=layout.rollout_tp, seed=config.seed,
                        kv_cache_gib=gen.kv_cache_gib,
                        max_model_len=config.data.max_prompt_len + gen.max_new_tokens)
    sync_weights(actor_chunks, arch, engine)
    rank = torch.distributed.get_rank()
    log = MetricsLog(config.run_dir, config.steps, 1, enabled=rank0)
    if rank0:
        print(f"megarl: {len(prompts.prompts)} prompts ({prompts.dropped_too_long} longer than "
              f"{config.data.max_prompt_len} tokens dropped); logs in {config.run_dir}", flush=True)

    metrics = {}
    for step in range(1, config.steps + 1):
        timer = PhaseTimer()
        sampling = SamplingConfig(n=gen.samples_per_prompt, temperature=gen.temperature,
                                  top_p=gen.top_p, max_new_tokens=gen.max_new_tokens,
                                  stop_token_ids=(tokenizer.eos_token_id,), seed=config.seed + step)
        step_prompts = [prompts.prompts[i] for i in sampler.next_batch()]
        with timer("generate"):
            engine.resume_memory()
            collected = collect(engine, step_prompts, sampling, tokenizer, reward_fn,
                                engine.data_parallel, engine.data_parallel_rank,
                                rank % layout.rollout_tp)
            engine.release_memory()
        batch = collected.batch
        with timer("old_logprobs"):
            batch = actor.logprobs(batch)
        if actor.reference is not None:
            with timer("ref_logprobs"):
                batch = actor.logprobs(batch, reference=True)
        if critic is not None:
            with timer("values"):
                batch = critic.values(batch)
        with timer("advantages"):
            batch = with_advantages(batch, config.algo, gen.max_new_tokens)
        with timer("actor_update"):
            actor_metrics = actor.update(batch)
        critic_metrics = {}
        if critic is not None:
            with timer("critic_update"):
                critic_metrics = critic.update(batch)
        with timer("sync"):
            sync_weights(actor_chunks, arch, engine)
        response_lengths = batch.loss_mask.sum(1)
        metrics = {
            "reward/mean": float(batch.rewards.mean()), "reward/std": float(batch.rewards.std()),
            "reward/failures": collected.reward_failures,
            "response/length_mean": float(response_lengths.mean()),
            "response/truncated": collected.truncated,
            **_rollout_mismatch(batch),
            **{f"actor/{k}": v for k, v in actor_metrics.items()},
            **{f"critic/{k}": v for k, v in critic_metrics.items()},
            **{f"time/{k}": v for k, v in timer.seconds.items()},
            "throughput/tokens_per_s": float(batch.lengths.sum()) / sum(timer.seconds.values()),
        }
        log.log(step, metrics)
    log.close()
    if rank0:
        print(f"megarl: mean reward over the first 10% of steps {log.reward_window(first=True):.3f}, "
              f"over the last 10% {log.reward_window(first=False):.3f}", flush=True)
        print(f"megarl: curves in {plot_run(config.run_dir)}; metrics in {config.run_dir}/metrics.jsonl, "
              f"TensorBoard: tensorboard --logdir {config.run_dir}/tensorboard", flush=True)
        # One sample of each of the last step's first six prompts.
        shown = {}
        for group, response, reward in zip(batch.group_ids.tolist(), collected.responses,
                                           batch.rewards.tolist()):
            shown.setdefault(group, (response, reward))
        for group, (response, reward) in list(shown.items())[:6]:
            print(f"[reward {reward:.1f}] {step_prompts[group].text!r} -> {response!r}", flush=True)
    engine.shutdown()
    return metrics
