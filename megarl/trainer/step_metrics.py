"""What one step reports: rewards, response lengths, the rollout/trainer gap (log-probs, and MoE
routing where the engine returned it) and what the rollout correction did about it, how old
asynchronous rollouts are, KL to the
reference, the update's metrics, phase times, throughput and memory. Pure reads of the trained
batch and the phases' results; the largest rank's peak memory is the one collective.
Does not own writing metrics (metrics.py) or FLOP counting (flops.py)."""

import torch

from megarl.actor.config import ActorConfig
from megarl.algos import mismatch, rollout_correction, staleness
from megarl.algos.distill import distill_metrics
from megarl.algos.kl import kl
from megarl.batch.rollout_batch import RolloutBatch
from megarl.parallel_state import megatron_groups
from megarl.planning.config import AlgoConfig
from megarl.rollout.collect import Collected
from megarl.trainer.metrics import PhaseTimer


def rollout_mismatch(batch: RolloutBatch, actor: ActorConfig, trainer_version: int) -> dict:
    out = {**mismatch.logprob_mismatch(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask),
           **rollout_correction.summary(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask,
                                        actor.rollout_correction.correction)}
    if batch.rollout_routing is not None and batch.old_routing is not None:
        out.update(mismatch.routing_mismatch(batch.rollout_routing, batch.old_routing))
        if batch.rollout_versions is not None:
            # Streamed samples carry their last request's routing, computed by their newest version:
            # where that is the trainer's, the two routed the same weights (lag 0).
            lag0 = staleness.newest_versions(batch.rollout_versions, batch.loss_mask) == trainer_version
            if bool(lag0.any()):
                out.update({f"{name}_lag0": value for name, value in mismatch.routing_mismatch(
                    batch.rollout_routing[lag0], batch.old_routing[lag0]).items()})
    return out


def rollout_staleness(batch: RolloutBatch, trainer_version: int) -> dict:
    if batch.rollout_versions is None:
        return {}
    return staleness.staleness_metrics(batch.rollout_versions, batch.loss_mask, trainer_version,
                                       batch.old_logprobs, batch.rollout_logprobs)


def kl_to_reference(batch: RolloutBatch, algo: AlgoConfig) -> dict:
    if batch.ref_logprobs is None:
        return {}
    per_token = kl(batch.old_logprobs, batch.ref_logprobs, algo.kl_estimator, algo.kl_clamp)
    return {"kl/actor_to_reference": float((per_token * batch.loss_mask).sum() / batch.loss_mask.sum())}


def distillation(batch: RolloutBatch) -> dict:
    if batch.teacher_logprobs is None:
        return {}
    return {name: float(value) for name, value in distill_metrics(
        batch.old_logprobs, batch.teacher_logprobs, batch.teacher_top1, batch.loss_mask).items()}


def reward_extras(extras: dict) -> dict:
    """Mean of each extra field a dict reward returned, over the samples that returned it."""
    return {f"reward/{name}_mean": float(values.nanmean()) for name, values in extras.items()
            if not values.isnan().all()}


def agent_events(events: dict, samples: int) -> dict:
    """Multi-turn rollouts' counted events (tool calls, errors, timeouts, cut outputs), and turns
    per sample."""
    out = {f"agent/{name}": count for name, count in events.items() if name != "turns"}
    if "turns" in events:
        out["agent/turns_mean"] = events["turns"] / samples
    return out


def max_over_ranks(value: int) -> int:
    """Pipeline stages and expert shards differ in memory: report the largest rank's. Collective."""
    tensor = torch.tensor([value], dtype=torch.float64, device=megatron_groups.device())
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return int(tensor.item())


def step_metrics(collected: Collected, batch: RolloutBatch, algo: AlgoConfig, actor: ActorConfig,
                 actor_metrics: dict, critic_metrics: dict, timer: PhaseTimer, trainer_version: int) -> dict:
    """`batch` is the trained one (collected.batch with log-probs, values and advantages);
    `trainer_version`: the step whose weights computed its old log-probs."""
    return {
        "reward/mean": float(batch.rewards.mean()), "reward/std": float(batch.rewards.std()),
        "reward/failures": collected.reward_failures, "reward/timeouts": collected.reward_timeouts,
        **reward_extras(collected.reward_extras),
        "response/length_mean": float(batch.loss_mask.sum(1).mean()),
        "response/length_max": int(batch.loss_mask.sum(1).max()),
        "response/truncated": collected.truncated,
        **agent_events(collected.events, batch.size),
        **rollout_mismatch(batch, actor, trainer_version), **rollout_staleness(batch, trainer_version),
        **kl_to_reference(batch, algo),
        **distillation(batch),
        **{f"actor/{k}": v for k, v in actor_metrics.items()},
        **{f"critic/{k}": v for k, v in critic_metrics.items()},
        **{f"time/{k}": v for k, v in timer.seconds.items()},
        "throughput/tokens_per_s": float(batch.lengths.sum()) / sum(timer.seconds.values()),
    }
