"""Advantage estimators: rewards (and values) -> per-token advantages and critic targets.

Owns the estimators, their registry, batch whitening and which estimators whiten by default. Does
not own rewards, the KL penalty (folded into the rewards first, see advantage_step.py) or batching:
group statistics and whitening span exactly the tensors passed in, so call these once on the whole
rollout batch, before it is split into micro-batches.

Every estimator takes the same keyword-only arguments, so `ADVANTAGE_ESTIMATORS[name](**inputs)`
works for any name: the inputs an estimator uses have no default (`lone_groups` defaults to
"zero"), the ones it ignores default to None. Each returns (advantages [B, T], returns [B, T]),
zero on masked tokens, not whitened (`whiten` is a separate step). Critic-free estimators return
their advantages as `returns`.

Standard deviations are sample (unbiased, n - 1) ones, like `torch.std` and verl. A group of one
sequence has no baseline: `lone_groups="zero"` gives it advantage 0 (it teaches nothing), "reward"
takes 0 as its baseline and 1 as its std, as verl does (GRPO: r / (1 + eps)).
"""

from typing import Callable, Dict, Optional, Tuple

import torch

Pair = Tuple[torch.Tensor, torch.Tensor]


def _group_sum(x: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """x [B] summed over each sequence's group, returned per sequence [B]."""
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    return x.new_zeros(len(groups)).index_add_(0, inverse, x)[inverse]


LONE_GROUPS = ("zero", "reward")


def _centered(seq_rewards: torch.Tensor, group_ids: torch.Tensor, lone_groups: str) -> Pair:
    """(r - group mean [B], group size [B]). A group of one centers to exactly 0 ("zero") or keeps
    r, its baseline being 0 ("reward")."""
    if lone_groups not in LONE_GROUPS:
        raise ValueError(f"lone_groups={lone_groups!r}; choose one of {LONE_GROUPS}")
    size = _group_sum(torch.ones_like(seq_rewards), group_ids)
    centered = seq_rewards - _group_sum(seq_rewards, group_ids) / size
    if lone_groups == "reward":
        centered = torch.where(size == 1, seq_rewards, centered)
    return centered, size


def whiten(advantages: torch.Tensor,  # [B, T]
           mask: torch.Tensor,  # [B, T]
           eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) over the real tokens of the whole batch [B, T]; 0 on padding.
    The std is the sample one; eps is added to the std (verl adds 1e-8 to the variance)."""
    weight = mask.bool().to(advantages.dtype)
    count = weight.sum()
    centered = (advantages - (advantages * weight).sum() / count) * weight
    std = ((centered ** 2).sum() / (count - 1).clamp(min=1)).sqrt()
    return centered / (std + eps)


def _discounted_advantages(token_rewards: torch.Tensor, values: torch.Tensor, keep: torch.Tensor,
                           gamma: float, lam: float) -> torch.Tensor:
    """GAE recursion over each row's real tokens [B, T]. A masked token is treated as absent:
    the recursion steps over it, so padding never leaks into earlier tokens, holes (e.g. tool
    output between turns) are skipped, and the value after the last real token is 0 (terminal)."""
    next_value = values.new_zeros(values.shape[0])  # [B]
    next_advantage = values.new_zeros(values.shape[0])  # [B]
    steps = []
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        next_advantage = torch.where(keep[:, t], advantage, next_advantage)
        steps.append(next_advantage)
    return torch.where(keep, torch.stack(steps[::-1], dim=1), 0)


def _per_token(seq_advantages: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T], 0 on padding."""
    return torch.where(keep, seq_advantages[:, None], 0)


def gae(*, token_rewards: torch.Tensor,  # [B, T]
        seq_rewards: Optional[torch.Tensor] = None,
        values: torch.Tensor,  # [B, T]
        mask: torch.Tensor,  # [B, T]
        group_ids: Optional[torch.Tensor] = None,
        gamma: float, lam: float, eps: Optional[float] = None,
        lone_groups: Optional[str] = None) -> Pair:
    """Generalized advantage estimation (PPO with a critic); returns = advantages + values.
    Not whitened: whitening (on by default for gae in a run) is the separate `whiten` step."""
    keep = mask.bool()
    advantages = _discounted_advantages(token_rewards, values, keep, gamma, lam)
    return advantages, torch.where(keep, advantages + values, 0)


def grpo(*, token_rewards: Optional[torch.Tensor] = None,
         seq_rewards: torch.Tensor,  # [B]
         values: Optional[torch.Tensor] = None,
         mask: torch.Tensor,  # [B, T]
         group_ids: torch.Tensor,  # [B] ints, groups may differ in size
         gamma: Optional[float] = None, lam: Optional[float] = None, eps: float,
         lone_groups: str = "zero") -> Pair:
    """(r - group mean) / (group sample std + eps), the same on every token of a sequence."""
    centered, size = _centered(seq_rewards, group_ids, lone_groups)
    std = (_group_sum(centered ** 2, group_ids) / (size - 1).clamp(min=1)).sqrt()
    std = torch.where(size == 1, 1.0, std)  # no spread to measure: "zero" is 0 anyway
    advantages = _per_token(centered / (std + eps), mask.bool())
    return advantages, advantages


def dr_grpo(*, token_rewards: Optional[torch.Tensor] = None,
            seq_rewards: torch.Tensor,  # [B]
            values: Optional[torch.Tensor] = None,
            mask: torch.Tensor,  # [B, T]
            group_ids: torch.Tensor,  # [B]
            gamma: Optional[float] = None, lam: Optional[float] = None,
            eps: Optional[float] = None, lone_groups: str = "zero") -> Pair:
    """Dr. GRPO: r - group mean, no std normalization."""
    advantages = _per_token(_centered(seq_rewards, group_ids, lone_groups)[0], mask.bool())
    return advantages, advantages


def rloo(*, token_rewards: Optional[torch.Tensor] = None,
         seq_rewards: torch.Tensor,  # [B]
         values: Optional[torch.Tensor] = None,
         mask: torch.Tensor,  # [B, T]
         group_ids: torch.Tensor,  # [B]
         gamma: Optional[float] = None, lam: Optional[float] = None,
         eps: Optional[float] = None, lone_groups: str = "zero") -> Pair:
    """REINFORCE leave-one-out: r_i - mean of the other members of its group, which is
    (r_i - group mean) * n / (n - 1). Alone: 0 or r (`lone_groups`)."""
    centered, size = _centered(seq_rewards, group_ids, lone_groups)
    advantages = _per_token(centered * size / (size - 1).clamp(min=1), mask.bool())
    return advantages, advantages


def reinforce_plus_plus(*, token_rewards: torch.Tensor,  # [B, T], KL penalty already folded in
                        seq_rewards: Optional[torch.Tensor] = None,
                        values: Optional[torch.Tensor] = None,
                        mask: torch.Tensor,  # [B, T]
                        group_ids: Optional[torch.Tensor] = None,
                        gamma: float, lam: Optional[float] = None, eps: Optional[float] = None,
                        lone_groups: Optional[str] = None) -> Pair:
    """REINFORCE++: discounted return-to-go (masked tokens skipped, as in gae). The algorithm
    whitens it over all real tokens of the batch: `whiten`, on by default for it in a run."""
    keep = mask.bool()
    advantages = _discounted_advantages(token_rewards, torch.zeros_like(token_rewards), keep, gamma, 1.0)
    return advantages, advantages


def reinforce_plus_plus_baseline(*, token_rewards: Optional[torch.Tensor] = None,
                                 seq_rewards: torch.Tensor,  # [B]
                                 values: Optional[torch.Tensor] = None,
                                 mask: torch.Tensor,  # [B, T]
                                 group_ids: torch.Tensor,  # [B]
                                 gamma: Optional[float] = None, lam: Optional[float] = None,
                                 eps: Optional[float] = None, lone_groups: str = "zero") -> Pair:
    """REINFORCE++ with baseline: r - group mean on every token. The algorithm whitens it over all
    real tokens of the batch, so longer sequences weigh more in the batch statistics: `whiten`,
    on by default for it in a run."""
    advantages = _per_token(_centered(seq_rewards, group_ids, lone_groups)[0], mask.bool())
    return advantages, advantages


ADVANTAGE_ESTIMATORS: Dict[str, Callable[..., Pair]] = {
    "gae": gae,
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_plus_plus": reinforce_plus_plus,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline,
}

# Whether a run whitens each estimator's advantages unless `algo.whiten_advantages` says otherwise:
# as the algorithms are defined and the anchors run them (GAE: verl and OpenRLHF whiten by
# default). GRPO already normalizes per group; Dr. GRPO and RLOO deliberately do not scale.
WHITENED_BY_DEFAULT: Dict[str, bool] = {
    "gae": True,
    "grpo": False,
    "dr_grpo": False,
    "rloo": False,
    "reinforce_plus_plus": True,
    "reinforce_plus_plus_baseline": True,
}
