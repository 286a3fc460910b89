"""torchrun worker of bench/bench_memory.py --phases: the measured memory of a training step's
phases, at several layouts, to set beside the memory plan's (planning/memory_plan.py).

For each layout: Megatron's groups for it, the process's memory before anything is built (the
baseline), then the real actor (build_model, TrainState with Megatron's distributed optimizer) on
a batch of full-length sequences that fill every micro-batch to its token budget. A first step
(old log-probs, update) allocates Adam's moments; the second is measured: each phase's peak minus
the baseline (platform/device_memory.py: on CPU the resident set's high-water mark), the
largest over ranks. Rank 0 prints one JSON line.
"""

import argparse
import gc
import json

import torch
import torch.distributed as dist

from megarl.actor.actor import Actor
from megarl.actor.config import ActorConfig, BatchingConfig
from megarl.batch.rollout_batch import RolloutBatch
from megarl.models.hf.config import arch_from_hf_config, load_hf_config
from megarl.models.megatron.builder import build_model
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims
from megarl.platform import device_memory


def full_batch(vocab: int, sequences: int, length: int) -> RolloutBatch:
    """`sequences` rows of exactly `length` tokens (the same on every rank)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(sequences, length)
    mask[:, :8] = 0  # the prompt
    return RolloutBatch(tokens=torch.randint(0, vocab, (sequences, length), generator=g),
                        lengths=torch.full((sequences,), length), loss_mask=mask,
                        group_ids=torch.arange(sequences // 2).repeat_interleave(2),
                        rewards=torch.randn(sequences, generator=g),
                        advantages=torch.randn(sequences, length, generator=g) * mask,
                        returns=torch.zeros(sequences, length))


def _most(nbytes: int) -> int:
    value = torch.tensor([nbytes], dtype=torch.int64, device=megatron_groups.device())  # NCCL: on the GPU
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value)


def measure(arch, dims: ParallelDims, batch: RolloutBatch, budget: int) -> dict:
    megatron_groups.initialize(dims)
    gc.collect()
    baseline = device_memory.in_use_bytes()
    config = ActorConfig(batching=BatchingConfig(micro_batch_tokens=budget))
    actor = Actor(build_model(arch, dims, perform_initialization=True), arch, config)
    peaks = {}
    for _ in range(2):  # the first allocates Adam's moments; the second's peaks are kept
        start = device_memory.in_use_bytes()
        with device_memory.measured() as memory:
            scored = actor.logprobs(batch)
        peaks["old_logprobs"] = start + memory.extra_bytes - baseline
        start = device_memory.in_use_bytes()
        with device_memory.measured() as memory:
            actor.update(scored)
        peaks["actor_update"] = start + memory.extra_bytes - baseline
    out = {phase: _most(nbytes) for phase, nbytes in peaks.items()}
    del actor, scored
    gc.collect()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--layouts", required=True, help="JSON [[name, ParallelDims fields], ...]")
    parser.add_argument("--sequences", type=int, required=True)
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--micro-batch-tokens", type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    world = megatron_groups.init_distributed()
    arch = arch_from_hf_config(load_hf_config(args.hf_dir))
    batch = full_batch(arch.vocab_size, args.sequences, args.length)
    result = {}
    for name, fields in json.loads(args.layouts):
        result[name] = measure(arch, ParallelDims(world_size=world, **fields), batch,
                               args.micro_batch_tokens)
    if megatron_groups.is_rank0():
        print(json.dumps(result), flush=True)
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
