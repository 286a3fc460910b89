"""Per-token KL estimators between the policy and the reference model.

Owns the estimators k1, k2, k3 (Schulman's naming), verl's low_var_kl, and their registry. Does
not own masking or reducing tokens (aggregation.py), nor whether KL is a reward penalty or a loss
term (the caller).
"""

from typing import Callable, Dict, Optional

import torch

from megarl.algos import pick


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T]
    """log pi - log pi_ref: unbiased, high variance, can be negative."""
    return logprobs - ref_logprobs


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T]
    """0.5 * (log pi - log pi_ref)^2: biased, low variance."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T]
    """exp(d) - d - 1 with d = log pi_ref - log pi: unbiased, non-negative. expm1 keeps precision
    when the policies are close."""
    log_ratio = ref_logprobs - logprobs
    return torch.expm1(log_ratio) - log_ratio


def low_var_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T]
    """verl's low_var_kl (its `k3`): k3 with the log-ratio limited to [-20, 20] and the value to
    [-10, 10]. verl clamps only this estimator, so `kl_clamp`, which limits any estimator (as
    OpenRLHF does), cannot reproduce verl's k1 or k2 and k3 together; this name reproduces its k3
    (verl writes exp(d) - d - 1; expm1 gives the same value without the rounding at small d)."""
    log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (torch.expm1(log_ratio) - log_ratio).clamp(-10.0, 10.0)


KL_ESTIMATORS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": k1, "k2": k2, "k3": k3, "low_var_kl": low_var_kl,
}


def kl(logprobs: torch.Tensor,  # [B, T]
       ref_logprobs: torch.Tensor,  # [B, T]
       estimator: str, clamp: Optional[float]) -> torch.Tensor:  # [B, T]
    """The `estimator`'s per-token KL, limited to [-clamp, clamp] when `clamp` is given, whatever
    the estimator (OpenRLHF's convention): k3 grows like exp(log pi_ref - log pi), so one token the
    policy has nearly ruled out can dominate a batch. None keeps the estimate as it is. verl's own
    clamp (k3 only) is the estimator low_var_kl."""
    if clamp is not None and clamp <= 0:
        raise ValueError(f"KL clamp {clamp} must be > 0 (or None for no clamp)")
    values = pick(KL_ESTIMATORS, estimator, "KL estimator")(logprobs, ref_logprobs)
    return values if clamp is None else values.clamp(-clamp, clamp)

