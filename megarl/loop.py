"""The RL loop of the 3D hybrid engine, one step per iteration, as in DESIGN.md's diagram:
generate -> reward -> old/ref log-probs, values -> advantages -> actor/critic update -> sync.

Every rank runs `train` (SPMD): the processes come from torchrun or from Ray (megarl/launch.py).
Each phase is one named call, timed under its name. Does not compute anything itself.
"""

import json
import os
from dataclasses import asdict, dataclass, replace
from typing import List, Optional, Tuple

import torch

from megarl import run_checkpoint, run_flops
from megarl.actor.actor import Actor
from megarl.actor.offload import generation_memory
from megarl.algos.advantage_step import advantage_step
from megarl.algos.kl import kl
from megarl.algos.shaping import informative_groups
from megarl.critic.critic import Critic
from megarl.models import checkpoint
from megarl.models.builder import build_model
from megarl.models.hf_config import arch_from_hf_config
from megarl.models.hf_export import export_hf
from megarl.models.hf_io import load_hf_weights
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims
from megarl.resharding.sync import sync_weights
from megarl.rollout.collect import Collected, collect, keep_informative
from megarl.rollout.engine import SamplingConfig
from megarl.rollout.prompts import Prompt, PromptSampler, load_prompts
from megarl.rollout.rewards import load_reward_fn
from megarl.rollout.vllm_engine import VLLMEngine
from megarl.run_config import AlgoConfig, RunConfig
from megarl.run_metrics import MetricsLog, PhaseTimer
from megarl.run_plots import plot_run


def with_advantages(batch, algo: AlgoConfig, max_new_tokens: int):
    """The batch with the configured estimator's advantages and returns (algos/advantage_step)."""
    advantages, returns = advantage_step(
        rewards=batch.rewards, mask=batch.loss_mask, group_ids=batch.group_ids, values=batch.values,
        logprobs=batch.old_logprobs, ref_logprobs=batch.ref_logprobs, estimator=algo.advantage,
        gamma=algo.gamma, lam=algo.lam, eps=algo.eps, whiten_advantages=algo.whitens,
        lone_groups=algo.lone_groups, kl_coeff=algo.kl_reward_coeff, kl_estimator=algo.kl_estimator,
        kl_clamp=algo.kl_clamp, max_response_len=max_new_tokens, overlong_buffer=algo.overlong_buffer,
        overlong_penalty=algo.overlong_penalty)
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


def _kl_to_reference(batch, algo: AlgoConfig) -> dict:
    if batch.ref_logprobs is None:
        return {}
    per_token = kl(batch.old_logprobs, batch.ref_logprobs, algo.kl_estimator, algo.kl_clamp)
    return {"kl/actor_to_reference": float((per_token * batch.loss_mask).sum() / batch.loss_mask.sum())}


@dataclass
class Run:
    """Everything one rank holds for a run, built once by `setup`."""
    config: RunConfig
    arch: object
    hf_config: dict
    actor: Actor
    critic: Optional[Critic]
    engine: VLLMEngine
    tokenizer: object
    prompts: List[Prompt]
    sampler: PromptSampler
    reward_fn: object
    device: str  # for MFU: the accelerator's name ("cpu" without one)


def setup(config: RunConfig, resume: Optional[str]) -> Tuple[Run, int]:
    """Processes, models, engine and data for `config`, restored from the checkpoint `resume`
    names (None, 'auto' or a path). Returns the run and the last step already done. Collective."""
    import transformers

    layout = config.layout
    world = megatron_groups.init_distributed(config.collective_timeout_s)
    if world != layout.world_size:
        raise ValueError(f"layout.world_size={layout.world_size} but {world} processes were started; "
                         "make them agree (torchrun --nproc-per-node, or let Ray place the workers)")
    dims = ParallelDims(world_size=world, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                        etp=layout.etp, vpp=layout.vpp)
    with open(os.path.join(config.model.hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    arch = arch_from_hf_config(hf_config)
    resume_from = run_checkpoint.resolve(config.run_dir, resume)
    # Refuse checkpoints this run cannot use before anything is built.
    if resume_from:
        run_checkpoint.read_trainer_file(resume_from, config, hf_config)
    if config.model.megatron_dir:
        checkpoint.require_model(config.model.megatron_dir, hf_config, config.model.hf_dir)
    megatron_groups.initialize(dims, seed=config.seed, timeout_s=config.collective_timeout_s)
    rank0 = megatron_groups.is_rank0()
    if rank0:
        os.makedirs(config.run_dir, exist_ok=True)
        with open(os.path.join(config.run_dir, "config.json"), "w") as f:
            json.dump(asdict(config), f, indent=2)

    actor_chunks = build_model(arch, dims, perform_initialization=False)
    _load(actor_chunks, arch, config, "policy")
    actor = Actor(actor_chunks, arch, config.actor_config)
    if config.actor.kl_loss_coeff or config.algo.kl_reward_coeff:
        actor.snapshot_reference()  # the initial weights, also when resuming
    critic = None
    if config.algo.uses_critic:
        critic_chunks = build_model(arch, dims, role="value")
        _load(critic_chunks, arch, config, "value")
        critic = Critic(critic_chunks, config.critic_config)

    tokenizer = transformers.AutoTokenizer.from_pretrained(config.model.hf_dir)
    data = config.data
    prompts = load_prompts(data.path, tokenizer, data.max_prompt_len, data.prompt_key, data.answer_key,
                           data.overlong_prompts)
    gen = config.generation
    engine = VLLMEngine(config.model.hf_dir, rollout_tp=layout.rollout_tp, seed=config.seed,
                        dtype=arch.dtype, kv_cache_gib=gen.kv_cache_gib,
                        gpu_memory_utilization=gen.gpu_memory_utilization,
                        max_model_len=config.data.max_prompt_len + gen.max_new_tokens)
    run = Run(config, arch, hf_config, actor, critic, engine, tokenizer, prompts.prompts,
              PromptSampler(len(prompts.prompts), config.data.prompts_per_step, config.data.seed),
              load_reward_fn(config.algo.reward), run_flops.device_name())
    done = run_checkpoint.load(run, resume_from) if resume_from else 0
    sync_weights(actor_chunks, arch, engine, rollout_tp=layout.rollout_tp)
    if rank0:
        resumed = f"; resumed from {resume_from} (step {done})" if resume_from else ""
        print(f"megarl: {len(prompts.prompts)} prompts ({prompts.dropped_too_long} longer than "
              f"{config.data.max_prompt_len} tokens dropped); logs in {config.run_dir}{resumed}", flush=True)
    return run, done


def rollouts(run: Run, number: int) -> Tuple[Collected, List[Prompt], List[int], dict]:
    """Step `number`'s rollouts, scored; the prompts their group ids index; the lengths of every
    sequence generated (kept or not). With DAPO dynamic sampling, groups whose rewards are all
    equal are dropped and more prompts are drawn, up to algo.dynamic_sampling_rounds extra
    rounds. Collective."""
    config, gen = run.config, run.config.generation
    extra_rounds = config.algo.dynamic_sampling_rounds
    parts, prompts, found = [], [], 0
    for round_ in range(extra_rounds + 1):
        batch_prompts = [run.prompts[i] for i in run.sampler.next_batch()]
        sampling = SamplingConfig(n=gen.samples_per_prompt, temperature=gen.temperature, top_p=gen.top_p,
                                  max_new_tokens=gen.max_new_tokens,
                                  stop_token_ids=(run.tokenizer.eos_token_id,),
                                  seed=config.seed + number * (extra_rounds + 1) + round_)
        parts.append(collect(run.engine, batch_prompts, sampling, run.tokenizer, run.reward_fn,
                             run.engine.data_parallel, run.engine.data_parallel_rank,
                             torch.distributed.get_rank() % config.layout.rollout_tp))
        prompts += batch_prompts
        if not extra_rounds:
            return parts[0], prompts, parts[0].batch.lengths.tolist(), {}
        batch = parts[-1].batch
        found += len(torch.unique(batch.group_ids[informative_groups(batch.rewards, batch.group_ids)]))
        if found >= config.data.prompts_per_step:
            break
    kept = keep_informative(parts, config.data.prompts_per_step)
    batch = kept.batch
    informative = torch.unique(batch.group_ids[informative_groups(batch.rewards, batch.group_ids)])
    generated = [n for part in parts for n in part.batch.lengths.tolist()]
    return kept, prompts, generated, {
        "dynamic_sampling/rounds": len(parts), "dynamic_sampling/informative_groups": found,
        "dynamic_sampling/uninformative_kept": len(torch.unique(batch.group_ids)) - len(informative)}


def step(run: Run, number: int):
    """One RL step. Returns (metrics, the collected rollouts, their prompts). Collective."""
    config, actor, critic, engine = run.config, run.actor, run.critic, run.engine
    states = [actor.state] + ([critic.state] if critic is not None else [])
    timer = PhaseTimer()
    run_flops.reset_peak_memory()
    # The hybrid-engine handoff: training state off the device, vLLM's KV cache in, and back.
    with timer("generate"), generation_memory(states, engine, config.offload_params) as offloaded:
        collected, prompts, generated, sampling_metrics = rollouts(run, number)
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
        batch = with_advantages(batch, config.algo, config.generation.max_new_tokens)
    with timer("actor_update"):
        actor_metrics = actor.update(batch)
    critic_metrics = {}
    if critic is not None:
        with timer("critic_update"):
            critic_metrics = critic.update(batch)
    with timer("sync"):
        engine.resume_memory(kv_cache=False)  # weights only: the training state is still here
        sync_weights(actor.state.chunks, run.arch, engine, rollout_tp=config.layout.rollout_tp)
    phases = run_flops.rl_phases(generated, batch.lengths.tolist(), reference=actor.reference is not None,
                                 critic=critic is not None, actor_epochs=config.actor.batching.epochs,
                                 critic_epochs=config.critic.batching.epochs)
    collected = replace(collected, batch=batch)
    metrics = {**_step_metrics(collected, actor_metrics, critic_metrics, timer),
               **_kl_to_reference(batch, config.algo), **sampling_metrics,
               **run_flops.throughput_metrics(run_flops.step_flops(run.arch, phases), timer.seconds,
                                              config.layout.world_size, run.device),
               "memory/offloaded_bytes": offloaded, "memory/peak_bytes": _max_over_ranks(
                   run_flops.peak_memory_bytes())}
    return metrics, collected, prompts


def _max_over_ranks(value: int) -> int:
    """Pipeline stages and expert shards differ in memory: report the largest rank's."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"  # NCCL: on the GPU
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return int(tensor.item())


def _step_metrics(collected, actor_metrics: dict, critic_metrics: dict, timer: PhaseTimer) -> dict:
    batch = collected.batch
    return {
        "reward/mean": float(batch.rewards.mean()), "reward/std": float(batch.rewards.std()),
        "reward/failures": collected.reward_failures,
        "response/length_mean": float(batch.loss_mask.sum(1).mean()),
        "response/truncated": collected.truncated,
        **_rollout_mismatch(batch),
        **{f"actor/{k}": v for k, v in actor_metrics.items()},
        **{f"critic/{k}": v for k, v in critic_metrics.items()},
        **{f"time/{k}": v for k, v in timer.seconds.items()},
        "throughput/tokens_per_s": float(batch.lengths.sum()) / sum(timer.seconds.values()),
    }


def _report(run: Run, log: MetricsLog, collected, prompts) -> None:
    """Where the logs are, the reward trend, and one sample of each of six prompts."""
    run_dir = run.config.run_dir
    print(f"megarl: mean reward over the first 10% of steps {log.reward_window(first=True):.3f}, "
          f"over the last 10% {log.reward_window(first=False):.3f}", flush=True)
    print(f"megarl: curves in {plot_run(run_dir)}; metrics in {run_dir}/metrics.jsonl, "
          f"TensorBoard: tensorboard --logdir {run_dir}/tensorboard", flush=True)
    shown = {}
    for group, response, reward in zip(collected.batch.group_ids.tolist(), collected.responses,
                                       collected.batch.rewards.tolist()):
        shown.setdefault(group, (response, reward))
    for group, (response, reward) in list(shown.items())[:6]:
        print(f"[reward {reward:.1f}] {prompts[group].text!r} -> {response!r}", flush=True)


def train(config: RunConfig, resume: Optional[str] = None) -> dict:
    """Run steps up to config.steps, from the checkpoint `resume` names (None, 'auto' or a path);
    returns the last step's metrics. Collective."""
    run, done = setup(config, resume)
    log = MetricsLog(config.run_dir, config.steps, done + 1, enabled=megatron_groups.is_rank0())
    every = config.checkpoint.every
    metrics = {}
    for number in range(done + 1, config.steps + 1):
        metrics, collected, prompts = step(run, number)
        log.log(number, metrics)
        if every and (number % every == 0 or number == config.steps):
            run_checkpoint.save(run, number, config.checkpoint.keep)
    log.close()
    if config.checkpoint.export_hf:
        export_hf(run.actor.state.chunks, run.arch, run.hf_config, config.model.hf_dir,
                  os.path.join(config.run_dir, "hf"))
    if log.enabled and done < config.steps:
        _report(run, log, collected, prompts)
    run.engine.shutdown()
    return metrics
