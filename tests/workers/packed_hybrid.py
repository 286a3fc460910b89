"""torchrun worker: a Gated DeltaNet hybrid's log-probs on sequences of different lengths packed
into one thd micro-batch, each sequence alone, and HF transformers on each sequence alone; rank 0
saves the three to --out. At TP = world size (the conv's channels and the state's heads split)."""

import argparse

import torch

from megarl.actor.actor import Actor
from megarl.actor.config import ActorConfig, BatchingConfig
from megarl.batch.rollout_batch import RolloutBatch
from megarl.checks import parity
from megarl.models.hf.config import load_arch
from megarl.models.hf.weights_io import load_hf_weights
from megarl.models.megatron.builder import build_model
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims

LENGTHS = [70, 5, 33, 5, 12]  # past one 64-token chunk, two alike, and shorter ones


def batch_of(tokens: torch.Tensor, lengths) -> RolloutBatch:
    mask = (torch.arange(tokens.shape[1])[None] < torch.tensor(lengths)[:, None]).float()
    mask[:, 0] = 0.0
    return RolloutBatch(tokens=tokens, lengths=torch.tensor(lengths), loss_mask=mask,
                        group_ids=torch.arange(len(lengths)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world = megatron_groups.init_distributed()
    dims = ParallelDims(world_size=world, tp=world)
    megatron_groups.initialize(dims)
    arch = load_arch(args.hf_dir)
    chunks = build_model(arch, dims, perform_initialization=False)
    load_hf_weights(chunks, arch, args.hf_dir)
    actor = Actor(chunks, arch, ActorConfig(batching=BatchingConfig(micro_batches=1)))
    tokens = parity.fixed_tokens(arch.vocab_size, len(LENGTHS), max(LENGTHS))
    packed = actor.logprobs(batch_of(tokens, LENGTHS)).old_logprobs
    alone = [actor.logprobs(batch_of(tokens[i:i + 1, :n], [n])).old_logprobs[0]
             for i, n in enumerate(LENGTHS)]
    hf = [parity.hf_run(args.hf_dir, tokens[i:i + 1, :n], backward=False).logprobs[0]
          for i, n in enumerate(LENGTHS)]
    if megatron_groups.is_rank0():
        torch.save({"lengths": LENGTHS, "packed": packed, "alone": alone, "hf": hf}, args.out)


if __name__ == "__main__":
    main()
