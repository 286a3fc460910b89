"""The critic's clipped value loss. Does not own aggregation (aggregation.py) or the value head."""

from typing import Tuple

import torch


def clipped_value_loss(values: torch.Tensor,  # [B, T] current critic
                       old_values: torch.Tensor,  # [B, T] critic at rollout time
                       returns: torch.Tensor,  # [B, T] targets from the advantage estimator
                       mask: torch.Tensor,  # [B, T]
                       eps_clip: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """0.5 * max((v - R)^2, (clip(v, old - eps, old + eps) - R)^2) per token [B, T], and where the
    clipped term won [B, T] (its token-mean is the clip fraction). Both are 0 on masked tokens."""
    keep = mask.bool()
    unclipped = (values - returns) ** 2
    clipped = (values.clamp(old_values - eps_clip, old_values + eps_clip) - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped)
    return torch.where(keep, loss, 0), (keep & (clipped > unclipped)).to(loss.dtype)
