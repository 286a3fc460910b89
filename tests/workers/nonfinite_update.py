"""torchrun worker: updates whose loss or gradients are not finite must be skipped on every rank.

At the given layout: one finite actor update (so Adam has moments), then an update whose batch
has a NaN advantage in a single row (so only the data-parallel rank holding it sees a NaN), then
a finite update again; the same for the critic with an inf return. Rank 0 saves, after each
update, the metrics and a copy of the full weights, every optimizer moment and the LR schedule's
step count, to OUT."""

import argparse
import json

import torch
from synthetic_batch import synthetic_batch  # noqa: I001 (next to this script)

from megarl.actor.actor import Actor
from megarl.actor.config import ActorConfig
from megarl.actor.optimizer import OptimConfig
from megarl.critic.config import CriticConfig
from megarl.critic.critic import Critic
from megarl.models.hf.config import arch_from_hf_config
from megarl.models.hf.weights_io import gather_hf_tensors
from megarl.models.megatron.builder import build_model
from megarl.models.weights import checkpoint
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims


def state_of(model, arch, role):
    inner = [o.optimizer for o in getattr(model.state.optimizer, "chained_optimizers",
                                          [model.state.optimizer])]
    moments = [v.clone() for o in inner for s in o.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]
    return dict(weights=gather_hf_tensors(model.state.chunks, arch, role=role), moments=moments,
                scheduler_steps=model.state.scheduler.num_steps)


def updates(model, arch, role, batches):
    history = []
    for batch in batches:
        metrics = model.update(batch)
        history.append(dict(metrics=metrics, **state_of(model, arch, role)))
    return history


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", required=True)
    parser.add_argument("--megatron-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world = megatron_groups.init_distributed()
    dims = ParallelDims(world_size=world, **json.loads(args.layout))
    megatron_groups.initialize(dims)
    arch = arch_from_hf_config(checkpoint.read_model_file(args.megatron_dir)["hf_config"])
    optim = OptimConfig(lr=1e-3)

    chunks = build_model(arch, dims, perform_initialization=False)
    checkpoint.load(chunks, args.megatron_dir)
    actor = Actor(chunks, arch, ActorConfig(optim=optim))
    batch = actor.logprobs(synthetic_batch(arch.vocab_size))
    poisoned = batch.advantages.clone()
    poisoned[3, batch.loss_mask[3].bool()] = float("nan")
    actor_history = updates(actor, arch, "policy",
                            [batch, batch.with_fields(advantages=poisoned), batch])

    critic = Critic(build_model(arch, dims, role="value"), CriticConfig(optim=optim))
    batch = critic.values(batch)
    returns = batch.returns.clone()
    returns[5, batch.loss_mask[5].bool()] = float("inf")
    critic_history = updates(critic, arch, "value", [batch, batch.with_fields(returns=returns), batch])
    if megatron_groups.is_rank0():
        torch.save(dict(actor=actor_history, critic=critic_history), args.out)
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
