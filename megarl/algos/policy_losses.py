"""Policy-gradient losses: per-token loss [B, T] and per-token clip indicator [B, T].

Owns PPO (clip-higher, dual-clip), GSPO, CISPO and their registry. Does not own reducing tokens
to a scalar (aggregation.py), computing log-probs (vocab_parallel.py) or the importance weights
against the rollout engine (rollout_correction.py).

Every loss takes the same keyword-only arguments, so `POLICY_LOSSES[name](**inputs)` works for any
name; `dual_clip` is PPO's alone and the others ignore it. Losses and indicators are 0 on masked
tokens. `is_weights` [B, T] (rollout_correction.apply) multiplies the loss, never the indicator.
"""

from typing import Callable, Dict, Optional, Tuple

import torch

Pair = Tuple[torch.Tensor, torch.Tensor]


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, eps_clip_low: float,
                       eps_clip_high: float) -> Pair:
    """max(-A * ratio, -A * clip(ratio)) and where the clipped term won (its gradient is 0)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_clip_low, 1 + eps_clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _finish(loss: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor,
            is_weights: Optional[torch.Tensor]) -> Pair:
    keep = mask.bool()
    if is_weights is not None:
        loss = loss * is_weights
    return torch.where(keep, loss, 0), (clipped & keep).to(loss.dtype)


def ppo(*, logprobs: torch.Tensor,  # [B, T]
        old_logprobs: torch.Tensor,  # [B, T]
        advantages: torch.Tensor,  # [B, T]
        mask: torch.Tensor,  # [B, T]
        eps_clip_low: float, eps_clip_high: float, dual_clip: Optional[float] = None,
        is_weights: Optional[torch.Tensor] = None) -> Pair:
    """Clipped PPO surrogate with ratio range [1 - eps_clip_low, 1 + eps_clip_high]. With
    dual_clip c > 1, a negative-advantage token's loss is also capped at -A * c; the indicator
    marks tokens whose gradient either clip removed."""
    loss, clipped = _clipped_surrogate(torch.exp(logprobs - old_logprobs), advantages, eps_clip_low,
                                       eps_clip_high)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be greater than 1 (or None to disable), got {dual_clip}")
        cap = -advantages * dual_clip
        capped = (advantages < 0) & (cap < loss)
        loss = torch.where(capped, cap, loss)
        clipped = clipped | capped
    return _finish(loss, clipped, mask, is_weights)


def gspo(*, logprobs: torch.Tensor,  # [B, T]
         old_logprobs: torch.Tensor,  # [B, T]
         advantages: torch.Tensor,  # [B, T], normally the same on every token of a sequence
         mask: torch.Tensor,  # [B, T]
         eps_clip_low: float, eps_clip_high: float, dual_clip: Optional[float] = None,
         is_weights: Optional[torch.Tensor] = None) -> Pair:
    """GSPO: one ratio per sequence, s_i = exp(mean over real tokens of logp - old_logp), clipped.
    Token t carries s_i,t = sg(s_i) * exp(logp_t - sg(logp_t)): its value is s_i and its gradient
    s_i * grad logp_t, so with "seq-mean-token-mean" aggregation this is the paper's objective."""
    keep = mask.bool()
    weight = keep.to(logprobs.dtype)
    log_ratio = torch.where(keep, logprobs - old_logprobs, 0)
    seq_log_ratio = log_ratio.sum(-1) / weight.sum(-1).clamp(min=1)  # [B]
    ratio = torch.exp(seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach())
    loss, clipped = _clipped_surrogate(ratio, advantages, eps_clip_low, eps_clip_high)
    return _finish(loss, clipped, mask, is_weights)


def cispo(*, logprobs: torch.Tensor,  # [B, T]
          old_logprobs: torch.Tensor,  # [B, T]
          advantages: torch.Tensor,  # [B, T]
          mask: torch.Tensor,  # [B, T]
          eps_clip_low: float, eps_clip_high: float, dual_clip: Optional[float] = None,
          is_weights: Optional[torch.Tensor] = None) -> Pair:
    """CISPO: -sg(clip(ratio)) * A * logp. Every token keeps its gradient; the indicator marks
    tokens whose importance weight was clipped."""
    ratio = torch.exp(logprobs - old_logprobs)
    low, high = 1 - eps_clip_low, 1 + eps_clip_high
    loss = -ratio.clamp(low, high).detach() * advantages * logprobs
    return _finish(loss, (ratio < low) | (ratio > high), mask, is_weights)


POLICY_LOSSES: Dict[str, Callable[..., Pair]] = {"ppo": ppo, "gspo": gspo, "cispo": cispo}

# The aggregation each loss is defined with, used unless one is chosen: GSPO's objective is a
# mean over sequences of token means (verl forces it; megarl lets an explicit choice stand).
DEFAULT_AGGREGATION: Dict[str, str] = {"ppo": "token-mean", "gspo": "seq-mean-token-mean",
                                       "cispo": "token-mean"}
