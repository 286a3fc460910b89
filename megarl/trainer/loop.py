"""The RL loop, one step per iteration:
generate -> reward -> old/ref log-probs, values -> advantages -> actor/critic update -> sync.

Every rank runs `train` (SPMD): the processes come from torchrun or from Ray (launch.py). With
rollout ranks of their own (layout.rollout_world_size), those keep an engine process serving
rollouts instead (rollout_ranks/supervisor.py, rollout_ranks/server.py) and the rest train. Each phase is one
named call, timed under its name. It orchestrates and computes nothing itself: where rollouts
come from is a RolloutSource (colocated: rollout_source.py; disaggregated:
disaggregated_rollouts.py), how samples are produced a SampleProducer
(megarl/rollout/producer.py), both chosen once in `setup`. The rollout side (tokenizer, prompts,
engine, producer) comes from the builder rollout ranks use too (megarl/rollout/builder.py); a
colocated one is made, its engine asleep, before any model (on a GPU vLLM starts only on a free
device), and the weights a step pushes are synced inside the next step's memory handoff; their
seconds are still booked as "sync". Held-out sets (eval.*) are evaluated by the source, with the
weights a step pushed, before a fresh run's first step (logged as step 0), every eval.every steps
and after the last (in that step's row).
"""

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Optional, Tuple

from megarl.actor.actor import Actor
from megarl.algos.advantage_step import advantage_step
from megarl.critic.critic import Critic
from megarl.critic.reward_model import RewardModel
from megarl.evaluation.eval_metrics import summary
from megarl.models.hf.config import ModelArch
from megarl.models.hf.weights_io import load_hf_weights
from megarl.models.lora import peft_io
from megarl.models.megatron.builder import build_model
from megarl.models.weights import checkpoint as model_checkpoint
from megarl.parallel_state import megatron_groups, roles
from megarl.planning import flops
from megarl.planning.config import AlgoConfig, RunConfig
from megarl.planning.resolved import ResolvedRun
from megarl.platform import device_memory
from megarl.resharding.hf_export import export_hf
from megarl.rewards.scorer import Scorer
from megarl.rollout.prompts import PromptSampler
from megarl.rollout_ranks.supervisor import supervise
from megarl.teacher.build import build_teacher
from megarl.trainer import checkpoint, console
from megarl.trainer.disaggregated_rollouts import DisaggregatedStart
from megarl.trainer.metrics import MetricsLog, PhaseTimer
from megarl.trainer.plots import plot_run
from megarl.trainer.rollout_source import ColocatedStart, Rollouts, RolloutSource
from megarl.trainer.step_metrics import max_over_ranks, step_metrics


def with_advantages(batch, algo: AlgoConfig, max_new_tokens: int):
    """The batch with the configured estimator's advantages and returns (algos/advantage_step)."""
    advantages, returns = advantage_step(
        rewards=batch.rewards, mask=batch.loss_mask, group_ids=batch.group_ids, values=batch.values,
        logprobs=batch.old_logprobs, ref_logprobs=batch.ref_logprobs, estimator=algo.advantage,
        gamma=algo.gamma, lam=algo.lam, eps=algo.eps, whiten_advantages=algo.whitens,
        lone_groups=algo.lone_groups, kl_coeff=algo.kl_reward_coeff, kl_estimator=algo.kl_estimator,
        kl_clamp=algo.kl_clamp, max_response_len=max_new_tokens, overlong_buffer=algo.overlong_buffer,
        overlong_penalty=algo.overlong_penalty, teacher_logprobs=batch.teacher_logprobs,
        distill_coeff=algo.distill.coeff)
    return batch.with_fields(advantages=advantages, returns=returns)


def _load(chunks, arch, config: RunConfig, role: str) -> None:
    if role == "policy" and config.model.megatron_dir:
        model_checkpoint.load(chunks, config.model.megatron_dir)
    else:
        load_hf_weights(chunks, arch, config.model.hf_dir, role=role)


@dataclass
class Run:
    """Everything one rank holds for a run, built once by `setup`."""
    resolved: ResolvedRun  # the run as preflight resolved it: config, arch, adapters, ...
    actor: Actor
    critic: Optional[Critic]
    source: RolloutSource
    sampler: PromptSampler  # the data position, saved in checkpoints
    device: str  # for MFU: the accelerator's name ("cpu" without one)
    teacher: Optional[object] = None  # on-policy distillation's (megarl/teacher)

    @property
    def config(self) -> RunConfig:
        return self.resolved.config

    @property
    def arch(self) -> ModelArch:
        return self.resolved.arch


@dataclass(frozen=True)
class StepResult:
    metrics: dict
    rollouts: Rollouts  # with the trained batch (log-probs, values, advantages)


def _rollout_start(resolved: ResolvedRun, role: Optional[roles.Role]):
    """Where this trainer rank's rollouts come from, made before its models: colocated engines
    (role None) or rollout ranks of their own."""
    return ColocatedStart(resolved) if role is None else DisaggregatedStart(resolved, role)


def setup(resolved: ResolvedRun, resume: Optional[str],
          role: Optional[roles.Role] = None) -> Tuple[Run, int]:
    """Processes, models, rollout source and data for the resolved run, restored from the
    checkpoint `resume` names (None, 'auto' or a path); `role`: this trainer rank's place in a
    disaggregated job (None: colocated engines). Returns the run and the last step already done.
    Collective."""
    config, arch, dims = resolved.config, resolved.arch, resolved.dims
    world = megatron_groups.init_distributed(config.collective_timeout_s, say=console.say)
    if world != config.layout.world_size:
        raise ValueError(f"layout.world_size={config.layout.world_size} but {world} processes were "
                         "started; make them agree (torchrun --nproc-per-node, or let Ray place the workers)")
    resume_from = checkpoint.resolve(config.run_dir, resume)
    # Refuse checkpoints this run cannot use before anything is built.
    if resume_from:
        checkpoint.read_trainer_file(resume_from, resolved)
    if config.model.megatron_dir:
        model_checkpoint.require_model(config.model.megatron_dir, resolved.hf_config, config.model.hf_dir)
    # Before Megatron seeds the RNGs (vLLM seeds them too), so the models are built as without it.
    start = _rollout_start(resolved, role)
    megatron_groups.initialize(dims, seed=config.seed, timeout_s=config.collective_timeout_s)
    rank0 = megatron_groups.is_rank0()
    if rank0:
        os.makedirs(config.run_dir, exist_ok=True)
        with open(os.path.join(config.run_dir, "config.json"), "w") as f:
            json.dump(asdict(config), f, indent=2)

    # Before the actor: a served teacher's checks (it answers, with the student's vocabulary) then
    # refuse a bad one in seconds, not after a giant actor has loaded; a colocated one is parked
    # on the host once loaded.
    teacher = build_teacher(resolved, **config.model.transformer_overrides())
    actor_chunks = build_model(arch, dims, perform_initialization=False, recompute=config.actor.recompute,
                               **config.model.transformer_overrides())
    _load(actor_chunks, arch, config, "policy")
    peft_io.start(actor_chunks, arch, resolved.adapters)
    actor = Actor(actor_chunks, arch, config.actor_config)
    if config.actor.kl_loss_coeff or config.algo.kl_reward_coeff:
        actor.snapshot_reference()  # the initial weights, also when resuming
    critic = None
    if config.algo.uses_critic:
        critic_chunks = build_model(arch, dims, role="value", recompute=config.critic.recompute,
                                    **config.model.transformer_overrides())
        _load(critic_chunks, arch, config, "value")
        critic = Critic(critic_chunks, config.critic_config)

    data, algo = config.data, config.algo
    sampler = PromptSampler(len(start.prompts.prompts), data.prompts_per_step, data.seed)
    reward_models = {path: RewardModel(path, dims, config.actor.batching, start.tokenizer,
                                       **config.model.transformer_overrides())
                     for path in resolved.reward_model_dirs}

    def scorer_of(table):
        return Scorer(table, algo.reward_workers, algo.reward_timeout_s, reward_models)

    source = start.source(sampler, scorer_of(algo.reward_table), scorer_of, actor.state,
                          [critic.state] if critic is not None else [])
    run = Run(resolved, actor, critic, source, sampler, flops.device_name(), teacher)
    done = checkpoint.load(run, resume_from) if resume_from else 0
    source.push_weights(actor_chunks, arch, version=done)
    if rank0:
        resumed = f"; resumed from {resume_from} (step {done})" if resume_from else ""
        sets = "".join(f"; held-out {name}: {size} prompts" for name, size in start.held_out_sizes.items())
        prompts = start.prompts
        console.say(f"megarl: {len(prompts.prompts)} prompts ({prompts.dropped_too_long} longer "
                    f"than {data.max_prompt_len} tokens dropped){sets}; logs in {config.run_dir}{resumed}")
    return run, done


def step(run: Run, number: int) -> StepResult:
    """One RL step. Collective."""
    config, actor, critic = run.config, run.actor, run.critic
    timer = PhaseTimer()
    device_memory.reset_peak()
    with timer("generate"):
        rollouts = run.source.rollouts(number)
    batch = rollouts.collected.batch
    with timer("old_logprobs"):
        batch = actor.logprobs(batch)
    if actor.reference is not None:
        with timer("ref_logprobs"):
            batch = actor.logprobs(batch, reference=True)
    if run.teacher is not None:
        with timer("teacher_logprobs"):
            batch = run.teacher.logprobs(batch)
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
        run.source.push_weights(actor.state.chunks, run.arch, version=number)
    # A colocated source syncs inside rollouts(), in its memory handoff: book that under "sync".
    timer.move("generate", "sync", rollouts.sync_seconds)
    phases = flops.rl_phases(rollouts.generated_lengths, batch.lengths.tolist(),
                             reference=actor.reference is not None, critic=critic is not None,
                             actor_epochs=config.actor.batching.epochs,
                             critic_epochs=config.critic.batching.epochs,
                             teacher=run.resolved.teacher_arch if run.resolved.teacher_dims else None)
    metrics = {**step_metrics(rollouts.collected, batch, config.algo, config.actor, actor_metrics,
                              critic_metrics, timer, trainer_version=number - 1),
               **rollouts.metrics,
               **flops.throughput_metrics(flops.step_flops(run.arch, phases), timer.seconds,
                                          config.layout.world_size, run.device),
               "memory/peak_bytes": max_over_ranks(device_memory.peak_bytes()),
               "memory/actor_optimizer_state_bytes": max_over_ranks(actor.state.state_bytes())}
    return StepResult(metrics, replace(rollouts, collected=replace(rollouts.collected, batch=batch)))


def _evaluation(run: Run, after: int) -> dict:
    """The held-out metrics of the weights after step `after` (0: the initial ones, a fresh run's
    at-start evaluation) where one is due, with the seconds this rank spent on it; else {}.
    Collective."""
    config = run.config.eval
    due = config.due_after(after, run.config.steps) if after else config.at_start and bool(config.sets)
    if not due:
        return {}
    start = time.perf_counter()
    metrics = run.source.evaluate(after)
    return {**metrics, "time/eval": time.perf_counter() - start}


def _log_evaluations(log: MetricsLog, evaluations) -> None:
    """Rows of their own for evaluations apart from a step's: a fresh run's at-start one, and
    those rollout ranks of their own finished meanwhile, each at the step whose weights it
    evaluated (so metrics.jsonl's eval rows may follow later steps' rows). Step 0's is shown."""
    for number, metrics in evaluations:
        log.log(number, metrics, trained=False)
        if number == 0 and log.enabled:
            console.say("\n".join(summary(metrics, 0)))


def _report(run: Run, log: MetricsLog, rollouts: Rollouts) -> None:
    """Where the logs are, the reward trend, the first and last held-out evaluations, and one
    sample of each of six prompts."""
    run_dir = run.config.run_dir
    first, last = log.reward_window(first=True), log.reward_window(first=False)
    console.say(f"megarl: mean reward over the first 10% of steps {first:.3f}, over the last 10% "
                f"{last:.3f}")
    evaluations = log.evaluations()
    for number, metrics in dict(evaluations[:1] + evaluations[-1:]).items():
        console.say("\n".join(summary(metrics, number)))
    console.say(f"megarl: curves in {plot_run(run_dir)}; {log.where()}")
    shown = {}
    collected = rollouts.collected
    for group, response, reward in zip(collected.batch.group_ids.tolist(), collected.responses,
                                       collected.batch.rewards.tolist()):
        shown.setdefault(group, (response, reward))
    for group, (response, reward) in list(shown.items())[:6]:
        console.say(f"[reward {reward:.1f}] {rollouts.prompts[group].text!r} -> {response!r}")


def train(resolved: ResolvedRun, resume: Optional[str] = None) -> dict:
    """Run the resolved run's steps up to config.steps, from the checkpoint `resume` names (None,
    'auto' or a path); returns the last step's metrics (a rollout rank returns {}). Collective."""
    config = resolved.config
    role = None
    if config.layout.disaggregated:
        layout = config.layout
        placement = roles.Placement(layout.world_size, layout.rollout_world_size, config.collective_timeout_s)
        if placement.role_of(roles.launcher_rank(placement)) == roles.ROLLOUT:
            supervise(resolved, placement, console.say)
            return {}
        role = roles.start(placement, roles.launcher_store(placement))
    run, done = setup(resolved, resume, role)
    log = MetricsLog(config.run_dir, config.steps, done + 1, enabled=megatron_groups.is_rank0(),
                     logger=config.logger, settings=asdict(config))
    at_start = _evaluation(run, 0) if done == 0 else {}
    # Rollout ranks of their own return only the request's seconds: the metrics come later.
    _log_evaluations(log, [(0, at_start)] if any(k.startswith("eval/") for k in at_start) else [])
    every = config.checkpoint.every
    result = None
    for number in range(done + 1, config.steps + 1):
        result = step(run, number)
        log.log(number, {**result.metrics, **_evaluation(run, number)})
        _log_evaluations(log, run.source.evaluations())
        if every and (number % every == 0 or number == config.steps):
            checkpoint.save(run, number, config.checkpoint.keep)
    log.close()
    if config.checkpoint.export_hf:  # with the adapters merged in, as the engine generates
        export_hf(run.actor.state.chunks, run.arch, resolved.hf_config, config.model.hf_dir,
                  os.path.join(config.run_dir, "hf"), say=console.say,
                  export_dtype=config.checkpoint.export_dtype)
    if resolved.adapters is not None:
        peft_io.save(run.actor.state.chunks, run.arch, resolved.adapters,
                     os.path.join(config.run_dir, "lora"), config.model.hf_dir)
    if log.enabled and result is not None:
        _report(run, log, result.rollouts)
    run.source.shutdown()
    if run.teacher is not None:
        run.teacher.shutdown()
    return result.metrics if result is not None else {}
