"""Which rows go where in an update: mini-batches per epoch, then this rank's packed micro-batches.

Owns the order of optimizer steps (epochs x mini-batches) and turning a mini-batch into this
data-parallel rank's micro-batches at the current layout. Shared by actor and critic.
"""

from typing import Callable, Dict, List, Optional

import torch

from megarl.actor.config import BatchingConfig
from megarl.actor.packing import PackedMicroBatch, pack, plan_micro_batches
from megarl.batch.rollout_batch import RolloutBatch
from megarl.parallel_state import megatron_groups


def mini_batch_rows(size: int, batching: BatchingConfig) -> List[torch.Tensor]:
    """Row indices [m] of every optimizer step, epoch after epoch."""
    step = batching.mini_batch_size or size
    if size % step:
        raise ValueError(f"batch of {size} sequences is not divisible by mini_batch_size={step}; "
                         "choose a divisor so every optimizer step sees the same number of sequences")
    steps = []
    for epoch in range(batching.epochs):
        order = torch.arange(size)
        if batching.shuffle_seed is not None:
            order = torch.randperm(size, generator=torch.Generator().manual_seed(
                batching.shuffle_seed + epoch))
        steps.extend(order.split(step))
    return steps


def local_micro_batches(batch: RolloutBatch, rows: torch.Tensor,
                        batching: BatchingConfig) -> List[PackedMicroBatch]:
    """This DP rank's packed micro-batches of the sequences `rows` [m]."""
    lengths = batch.lengths[rows].tolist()
    interleaved = megatron_groups.virtual_stages()
    plan = plan_micro_batches(lengths, megatron_groups.data().size,
                              batching.micro_batch_tokens, batching.micro_batches,
                              min_micro_batches=megatron_groups.pipeline().size
                              if interleaved > 1 else 1)
    tp, cp = megatron_groups.tensor().size, megatron_groups.context().size
    return [pack(batch.tokens, batch.lengths, [int(rows[i]) for i in part], tp, cp,
                 megatron_groups.context().rank)
            for part in plan[megatron_groups.data().rank]]


def global_counts(batch: RolloutBatch, rows: torch.Tensor, norm_tokens: Optional[int]) -> dict:
    """The aggregation constants of the mini-batch `rows`, the same on every rank and, for
    Dr. GRPO's `norm_tokens` (None where the aggregation needs none), every step."""
    return dict(global_tokens=batch.loss_mask[rows].sum(), global_seqs=len(rows), max_len=norm_tokens)


def mean_over_steps(batch: RolloutBatch, batching: BatchingConfig,
                    step: Callable[[torch.Tensor], Dict[str, float]]) -> Dict[str, float]:
    """Run `step(rows)` for every optimizer step; metrics averaged over the steps."""
    history = [step(rows) for rows in mini_batch_rows(batch.size, batching)]
    return {k: sum(h[k] for h in history) / len(history) for k in history[0]}
