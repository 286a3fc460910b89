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
    layout = (megatron_groups.data(), megatron_groups.tensor().size, megatron_groups.context(),
              megatron_groups.pipeline().size, megatron_groups.virtual_stages())
    key = (batching, layout, tuple(rows.tolist()))
    if _last.tokens is batch.tokens and _last.lengths is batch.lengths and _last.key == key:
        return _last.packs
    dp, tp, cp, pp, interleaved = layout
    plan = plan_micro_batches(batch.lengths[rows].tolist(), dp.size, batching.micro_batch_tokens,
                              batching.micro_batches, min_micro_batches=pp if interleaved > 1 else 1)
    packs = [pack(batch.tokens, batch.lengths, [int(rows[i]) for i in part], tp, cp.size, cp.rank)
             for part in plan[dp.rank]]
    _last.tokens, _last.lengths, _last.key, _last.packs = batch.tokens, batch.lengths, key, packs
    return packs


class _LastPacks:
    """The forward-only passes of a step (old and reference log-probs, values) pack the same rows
    of the same batch: the last packing is reused while the batch's token tensors (held here, so
    their identity cannot be recycled), the rows, the batching and the layout are the same."""
    tokens = lengths = key = packs = None


_last = _LastPacks()


def global_counts(batch: RolloutBatch, rows: torch.Tensor, norm_tokens: Optional[int]) -> dict:
    """The aggregation constants of the mini-batch `rows`, the same on every rank and, for
    Dr. GRPO's `norm_tokens` (None where the aggregation needs none), every step. A rollout
    correction may reject every token of a mini-batch: its loss is then 0, not 0 / 0."""
    return dict(global_tokens=batch.loss_mask[rows].sum().clamp(min=1), global_seqs=len(rows),
                max_len=norm_tokens)


def mean_over_steps(batch: RolloutBatch, batching: BatchingConfig,
                    step: Callable[[torch.Tensor], Dict[str, float]]) -> Dict[str, float]:
    """Run `step(rows)` for every optimizer step; metrics averaged over the steps."""
    history = [step(rows) for rows in mini_batch_rows(batch.size, batching)]
    return {k: sum(h[k] for h in history) / len(history) for k in history[0]}
