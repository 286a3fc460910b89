"""A step's advantages from its scored rollouts: sequence scores -> token rewards (DAPO overlong
shaping, KL penalty) -> the estimator -> optional whitening. A pure function of tensors and floats.

Owns where rewards sit and how the KL penalty reaches every estimator. Does not own the estimators
(advantages.py), the KL estimators (kl.py) or the shaping (shaping.py).

The KL penalty is subtracted per token from the token rewards, and every estimator reads the same
rewards: token-level estimators (gae, reinforce_plus_plus) walk the token rewards, outcome
estimators (grpo, dr_grpo, rloo, reinforce_plus_plus_baseline) score each sequence by the sum of
its token rewards, i.e. its reward minus its summed penalty. This is what verl computes, and it
keeps the penalty a penalty for every estimator instead of refusing the combination.
"""

from typing import Optional, Tuple

import torch

from megarl.algos import pick, shaping
from megarl.algos.advantages import ADVANTAGE_ESTIMATORS, whiten
from megarl.algos.distill import distill_advantages
from megarl.algos.kl import kl


def token_rewards(seq_rewards: torch.Tensor,  # [B]
                  mask: torch.Tensor  # [B, T]
                  ) -> torch.Tensor:  # [B, T]
    """Each sequence's score on its last real token, 0 elsewhere."""
    width = mask.shape[1]
    last = (mask.bool() * torch.arange(1, width + 1)).argmax(1)  # [B]
    out = torch.zeros(mask.shape, dtype=seq_rewards.dtype)
    out[torch.arange(len(seq_rewards)), last] = seq_rewards
    return out


def advantage_step(*, rewards: torch.Tensor,  # [B] the reward function's scores
                   mask: torch.Tensor,  # [B, T] response tokens
                   group_ids: torch.Tensor,  # [B]
                   values: Optional[torch.Tensor],  # [B, T] critic values (gae)
                   logprobs: Optional[torch.Tensor],  # [B, T] old log-probs (KL penalty)
                   ref_logprobs: Optional[torch.Tensor],  # [B, T] (KL penalty)
                   estimator: str, gamma: float, lam: float, eps: float, whiten_advantages: bool,
                   lone_groups: str, kl_coeff: float, kl_estimator: str, kl_clamp: Optional[float],
                   max_response_len: int, overlong_buffer: int, overlong_penalty: float,
                   teacher_logprobs: Optional[torch.Tensor] = None,  # [B, T] (distillation)
                   distill_coeff: float = 0.0
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(advantages [B, T], returns [B, T]) of the whole rollout batch. Returns (the critic's
    targets) are never whitened; only the advantages are. With `distill_coeff` the teacher's
    per-token reverse-KL term is added to the (whitened) advantages (algos/distill.py); the
    critic's returns stay the reward's."""
    scores = rewards.to(torch.promote_types(rewards.dtype, torch.float32))  # [B]
    if overlong_buffer:
        scores = scores + shaping.overlong_penalty(mask.sum(1), max_response_len, overlong_buffer,
                                                   overlong_penalty)
    per_token = token_rewards(scores, mask)
    if kl_coeff:
        penalty = kl_coeff * kl(logprobs, ref_logprobs, kl_estimator, kl_clamp)
        per_token = per_token - torch.where(mask.bool(), penalty, 0)  # padding may hold anything
    advantages, returns = pick(ADVANTAGE_ESTIMATORS, estimator, "advantage estimator")(
        token_rewards=per_token, seq_rewards=per_token.sum(1), values=values, mask=mask,
        group_ids=group_ids, gamma=gamma, lam=lam, eps=eps, lone_groups=lone_groups)
    if whiten_advantages:
        advantages = whiten(advantages, mask, eps)
    if distill_coeff:
        advantages = distill_advantages(advantages, logprobs, teacher_logprobs, mask, distill_coeff)
    return advantages, returns
