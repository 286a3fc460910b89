"""Supervised fine-tuning with the actor's own machinery: a batch of (prompt, target) token
sequences trained by maximum likelihood on the target tokens.

With old_logprobs equal to the current policy and advantage 1 on every target token, the PPO
surrogate's gradient is exactly the gradient of the targets' mean log-likelihood (token-mean),
so SFT needs no second training path. Used to warm-start the demo model.
"""

from typing import List, Optional, Sequence, Tuple

import torch

from megarl.actor.actor import Actor
from megarl.batch.rollout_batch import RolloutBatch


def sft_batch(pairs: List[Tuple[List[int], List[int]]],
              masks: Optional[Sequence[Sequence[int]]] = None) -> RolloutBatch:
    """(prompt ids, target ids) -> rows with the loss on the target tokens (where masks[i], one
    0/1 per target token, is 1: a multi-turn trace keeps inserted tokens out); one group each."""
    lengths = torch.tensor([len(p) + len(t) for p, t in pairs])
    tokens = torch.zeros(len(pairs), int(lengths.max()), dtype=torch.long)
    mask = torch.zeros(tokens.shape)
    for row, (prompt, target) in enumerate(pairs):
        tokens[row, :len(prompt) + len(target)] = torch.tensor(prompt + target)
        mask[row, len(prompt):len(prompt) + len(target)] = 1.0 if masks is None else torch.tensor(
            masks[row], dtype=torch.float32)
    return RolloutBatch(tokens=tokens, lengths=lengths, loss_mask=mask,
                        group_ids=torch.arange(len(pairs)))


def sft_step(actor: Actor, batch: RolloutBatch) -> dict:
    """One maximum-likelihood update; `actor/policy_loss` is minus the mean target log-prob
    *ratio* (-1 at the start of the step); the returned `nll` is the real loss before it."""
    batch = actor.logprobs(batch)
    nll = float(-(batch.old_logprobs * batch.loss_mask).sum() / batch.loss_mask.sum())
    metrics = actor.update(batch.with_fields(advantages=batch.loss_mask.clone()))
    return {"nll": nll, **metrics}
