"""Rollout correction: importance weights and rejection against the rollout engine's log-probs.

The engine that sampled a token and the trainer that scores it differ (kernels, precision, MoE
routing), so the samples come from pi_rollout, not pi_old. With rho = pi_old / pi_rollout (both
fixed during the update; "decoupled" in verl's words) a correction
  - weights the per-token loss by rho at one level: "token" (rho_t) or "sequence" (the product
    of the sequence's rho_t), truncated at `cap` (truncated IS) or left whole (masked IS);
  - drops from the loss the tokens or sequences whose ratio lies outside [low, high] at one
    level: "token", "sequence" or "geometric" (the geometric mean of the sequence's rho_t).
Owns those two mechanisms, the presets the anchors name, and what a correction did (fractions
masked and truncated). Pure functions of tensors; the actor applies the result to its loss.
"""

import math
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional

import torch

WEIGHT_LEVELS = ("token", "sequence")
REJECT_LEVELS = ("token", "sequence", "geometric")
# exp(+-20) keeps a long sequence's product of ratios finite (verl bounds it the same way).
_LOG_BOUND = 20.0


@dataclass(frozen=True)
class Correction:
    weights: Optional[str] = None  # level of the IS weights (WEIGHT_LEVELS); None: weight 1
    cap: Optional[float] = None  # truncate the weights at cap; None: whole ratios (masked IS)
    reject: Optional[str] = None  # level of rejection (REJECT_LEVELS); None: keep every token
    low: Optional[float] = None  # reject below low; None: 1 / high
    high: Optional[float] = None  # reject above high

    def __post_init__(self):
        if self.weights is not None and self.weights not in WEIGHT_LEVELS:
            raise ValueError(f"rollout correction weights={self.weights!r}: choose one of "
                             f"{list(WEIGHT_LEVELS)} or null (no weights)")
        if self.reject is not None and self.reject not in REJECT_LEVELS:
            raise ValueError(f"rollout correction reject={self.reject!r}: choose one of "
                             f"{list(REJECT_LEVELS)} or null (no rejection)")
        if self.cap is not None and (self.weights is None or self.cap <= 0):
            raise ValueError(f"rollout correction cap={self.cap} needs weights set and a cap > 0")
        if self.reject is None and (self.low is not None or self.high is not None):
            raise ValueError(f"rollout correction bounds low={self.low}, high={self.high} need "
                             "reject set to a level")
        if self.reject is not None:
            if self.high is None:
                raise ValueError(f"rollout correction reject={self.reject!r} needs high (and "
                                 "optionally low; default 1 / high)")
            if not 0 < self.bounds[0] <= 1 <= self.bounds[1]:
                raise ValueError(f"rollout correction bounds [{self.bounds[0]}, {self.bounds[1]}] "
                                 "must satisfy 0 < low <= 1 <= high")

    @property
    def bounds(self):
        return (1 / self.high if self.low is None else self.low), self.high

    @property
    def active(self) -> bool:
        return self.weights is not None or self.reject is not None


# Named as verl (RolloutCorrectionConfig's presets) and slime (--use-tis, MIS) name them; IcePop's
# bounds are the Ring-1T report's [0.5, 5].
PRESETS: Dict[str, Correction] = {
    "off": Correction(),
    "tis": Correction(weights="token", cap=2.0),
    "decoupled_token_is": Correction(weights="token", cap=2.0),
    "decoupled_seq_is": Correction(weights="sequence", cap=2.0),
    "decoupled_seq_is_rs": Correction(weights="sequence", cap=2.0, reject="sequence", high=2.0),
    "decoupled_geo_rs": Correction(reject="geometric", low=0.999, high=1.001),
    "token_mis": Correction(weights="token", reject="token", low=0.5, high=2.0),
    "seq_mis": Correction(weights="sequence", reject="sequence", low=0.5, high=2.0),
    "icepop": Correction(weights="token", reject="token", low=0.5, high=5.0),
}


class Corrected(NamedTuple):
    weights: Optional[torch.Tensor]  # [B, T] detached, 0 where not kept; None: no weights
    keep: torch.Tensor  # [B, T] bool: the loss mask after rejection


def log_ratio(old_logprobs: torch.Tensor,  # [B, T] the trainer's before the update
              rollout_logprobs: torch.Tensor,  # [B, T] the engine's
              mask: torch.Tensor,  # [B, T]
              level: str) -> torch.Tensor:
    """log rho at `level` [B, T] (a sequence's value on each of its tokens), bounded to +-20;
    0 on masked tokens."""
    keep = mask.bool()
    per_token = torch.where(keep, old_logprobs - rollout_logprobs, 0).to(torch.float64)
    if level == "token":
        value = per_token
    elif level in ("sequence", "geometric"):
        value = per_token.sum(-1, keepdim=True)
        if level == "geometric":
            value = value / keep.sum(-1, keepdim=True).clamp(min=1)
        value = value.expand_as(per_token)
    else:
        raise ValueError(f"unknown ratio level {level!r}; choose one of {list(REJECT_LEVELS)}")
    return torch.where(keep, value.clamp(-_LOG_BOUND, _LOG_BOUND), 0).to(old_logprobs.dtype)


def apply(old_logprobs: torch.Tensor,  # [B, T]
          rollout_logprobs: torch.Tensor,  # [B, T]
          mask: torch.Tensor,  # [B, T]
          correction: Correction) -> Corrected:
    """The loss weights and the kept tokens of `correction`."""
    keep = mask.bool()
    if correction.reject is not None:
        low, high = correction.bounds
        ratio = log_ratio(old_logprobs, rollout_logprobs, mask, correction.reject)
        keep = keep & (ratio >= math.log(low)) & (ratio <= math.log(high))
    weights = None
    if correction.weights is not None:
        weights = torch.exp(log_ratio(old_logprobs, rollout_logprobs, mask, correction.weights))
        if correction.cap is not None:
            weights = weights.clamp(max=correction.cap)
        weights = torch.where(keep, weights, 0).detach()
    return Corrected(weights, keep)


def summary(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
            correction: Correction) -> Dict[str, float]:
    """What `correction` did to the real tokens: the fraction it dropped from the loss, the
    fraction of kept tokens whose weight it truncated, and the kept tokens' mean weight."""
    real = mask.bool()
    corrected = apply(old_logprobs, rollout_logprobs, mask, correction)
    total, kept = int(real.sum()), int(corrected.keep.sum())
    out = {"correction/masked_fraction": 1 - kept / max(total, 1)}
    if corrected.weights is not None:
        whole = torch.exp(log_ratio(old_logprobs, rollout_logprobs, mask, correction.weights))
        truncated = corrected.keep & (whole > correction.cap) if correction.cap is not None \
            else torch.zeros_like(real)
        out["correction/truncated_fraction"] = int(truncated.sum()) / max(kept, 1)
        out["correction/weight_mean"] = float(corrected.weights[corrected.keep].sum()) / max(kept, 1)
    return out
