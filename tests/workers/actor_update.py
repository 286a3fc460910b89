"""torchrun worker: at each of several layouts of one world size, for each actor case, load a
model, compute old log-probs (packed), the same log-probs from a padded forward and run one actor
update; for each critic case, run critic updates. Rank 0 saves log-probs, metrics and the full
updated weights (a critic: its losses and values) to OUT_DIR/LAYOUT/NAME.pt. One launch serves
many layouts: starting one costs more than all of a layout's updates."""

import argparse
import dataclasses
import json
import os

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from synthetic_batch import synthetic_batch  # noqa: I001 (next to this script)

from megarl.actor.actor import Actor
from megarl.actor.config import ActorConfig, BatchingConfig, RolloutCorrectionConfig
from megarl.actor.optimizer import OptimConfig
from megarl.critic.config import CriticConfig
from megarl.critic.critic import Critic
from megarl.models.hf.config import arch_from_hf_config
from megarl.models.hf.weights_io import gather_hf_tensors
from megarl.models.megatron.builder import build_model
from megarl.models.megatron.portable_layers import cp_positions
from megarl.models.weights import checkpoint
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims


def padded_logprobs(chunks, arch, batch):
    """Reference for the packed path: one padded [N, L] forward of the whole batch (Megatron's
    causal mask, no packing, no schedule), log-prob of each token from position i-1. Pipeline
    size 1 only; with a pipeline rank 0 holds no logits, and the test skips those layouts."""
    if megatron_groups.pipeline().size > 1:
        return None
    cp, width = megatron_groups.context(), batch.width

    def columns(rank):  # the columns CP rank `rank` holds: Megatron's load-balanced split
        return cp_positions(width // cp.size, rank, cp.size, None) if cp.size > 1 else torch.arange(width)

    chunks[0].eval()
    with torch.no_grad():
        logits = chunks[0](batch.tokens[:, columns(cp.rank)], None, None)  # [N, L/cp, V/tp]
    full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., :arch.vocab_size]
    targets = torch.roll(batch.tokens, -1, 1)[:, columns(cp.rank)]  # the token each column predicts
    mine = torch.log_softmax(full.float(), -1).gather(-1, targets[..., None])[..., 0]  # [N, L/cp]
    parts = [torch.empty_like(mine) for _ in range(cp.size)]
    dist.all_gather(parts, mine, group=cp.group)
    picked = torch.empty(batch.size, width)
    for rank, part in enumerate(parts):
        picked[:, columns(rank)] = part
    return torch.cat([torch.zeros(batch.size, 1), picked[:, :-1]], 1)


def actor_case(args, dims, megatron_dir, batching, actor_overrides):
    arch = arch_from_hf_config(checkpoint.read_model_file(megatron_dir)["hf_config"])
    chunks = build_model(arch, dims, perform_initialization=False)
    checkpoint.load(chunks, megatron_dir)
    batch = synthetic_batch(arch.vocab_size, max_len=args.max_len)
    padded = padded_logprobs(chunks, arch, batch)
    optim = {"lr": args.lr, "clip_grad": args.clip_grad, "adam_eps": args.adam_eps,
             **actor_overrides.pop("optim", {})}
    correction = RolloutCorrectionConfig(**actor_overrides.pop("rollout_correction", {}))
    config = ActorConfig(batching=batching, optim=OptimConfig(**optim), rollout_correction=correction,
                         **actor_overrides)
    initial = gather_hf_tensors(chunks, arch)
    actor = Actor(chunks, arch, config)
    actor.snapshot_reference()
    batch = actor.logprobs(batch)
    noise = torch.randn(batch.tokens.shape, generator=torch.Generator().manual_seed(1))
    # Stand-ins a few hundredths of a nat away, so KL and IS terms have non-trivial gradients.
    batch = batch.with_fields(ref_logprobs=batch.old_logprobs + 0.1 * noise * batch.loss_mask,
                              rollout_logprobs=batch.old_logprobs - 0.05 * noise * batch.loss_mask)
    replayed = {}
    if config.router_replay == "old":
        # The old pass's routing replayed as if the engine had returned it (R3's path): the same
        # experts reproduce the log-probs, shifted ones do not; the routers report using them.
        recorded = batch.old_routing
        shifted = torch.where(recorded >= 0, (recorded + 1) % arch.num_experts, recorded)
        actor.config = dataclasses.replace(config, router_replay="rollout")
        same = actor.logprobs(batch.with_fields(rollout_routing=recorded))
        moved = actor.logprobs(batch.with_fields(rollout_routing=shifted))
        actor.config = config
        replayed = dict(replay_same=same.old_logprobs, replay_shifted=moved.old_logprobs,
                        used_same=same.old_routing, used_shifted=moved.old_routing,
                        experts=arch.num_experts)
    metrics = actor.update(batch)
    after = actor.logprobs(batch).old_logprobs
    reference_after = actor.logprobs(batch, reference=True).ref_logprobs
    after_again = actor.logprobs(batch).old_logprobs
    weights = gather_hf_tensors(chunks, arch)
    return dict(old_logprobs=batch.old_logprobs, padded_logprobs=padded, metrics=metrics,
                weights=weights, initial_weights=initial, logprobs_after=after,
                reference_after=reference_after,
                after_again=after_again, mask=batch.loss_mask,
                old_routing=batch.old_routing, **replayed)


def critic_case(args, dims, megatron_dir, batching):
    arch = arch_from_hf_config(checkpoint.read_model_file(megatron_dir)["hf_config"])
    chunks = build_model(arch, dims, role="value")
    batch = synthetic_batch(arch.vocab_size, max_len=args.max_len)
    # A learnable target: each sequence's reward on its response tokens (as with gamma = lam = 1).
    batch = batch.with_fields(returns=batch.rewards[:, None] * batch.loss_mask)
    critic = Critic(chunks, CriticConfig(batching=batching, value_clip=100.0,
                                         optim=OptimConfig(lr=args.lr, clip_grad=args.clip_grad,
                                                                   adam_eps=args.adam_eps)))
    losses = []
    for _ in range(args.critic_steps):
        batch = critic.values(batch)
        losses.append(critic.update(batch)["value_loss"])
    return dict(value_losses=losses, values=critic.values(batch).values)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True,
                        help="JSON list of [layout name, ParallelDims fields, cases]; a case is "
                             "[name, 'actor' or 'critic', megatron_dir, batching dict, actor overrides]")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--clip-grad", type=float, default=1.0)
    # Adam divides by |g| + eps: where |g| is near 1e-8, gradient rounding (~1e-9 between layouts)
    # would move the update by a tenth of lr; eps 1e-6 keeps layout comparisons meaningful.
    parser.add_argument("--adam-eps", type=float, default=1e-6)
    parser.add_argument("--max-len", type=int, default=40)
    parser.add_argument("--critic-steps", type=int, default=5, help="updates of each critic case")
    args = parser.parse_args()
    world = megatron_groups.init_distributed()
    for layout, fields, cases in json.loads(args.layouts):
        dims = ParallelDims(world_size=world, **fields)
        out_dir = os.path.join(args.out_dir, layout)
        os.makedirs(out_dir, exist_ok=True)
        for name, role, megatron_dir, batching, overrides in cases:
            # Groups rebuilt and every RNG seeded for each case, as in a launch of its own: the
            # critic's value head starts from random weights, the same at every layout.
            megatron_groups.initialize(dims)
            batching = BatchingConfig(**batching)
            if role == "critic":
                result = critic_case(args, dims, megatron_dir, batching)
            else:
                result = actor_case(args, dims, megatron_dir, batching, overrides)
            if megatron_groups.is_rank0():
                torch.save(result, os.path.join(out_dir, f"{name}.pt"))
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
