"""How old asynchronous rollouts are when they are trained on, and how far each version's tokens
are from the trainer: pure functions of the per-token policy versions.

A token's lag is the trainer's version (the weights the step's old log-probs come from) minus
the version that sampled it. Tokens of lag 0 were sampled by the very weights the trainer
recomputes them with, so their log-prob gap is the engine-trainer mismatch alone; larger lags add
the policy's drift, which the decoupled loss (proximal = old log-probs, behaviour = the engine's
per-token log-probs; actor.rollout_correction) corrects for.
"""

from typing import Dict

import torch


def token_lags(versions: torch.Tensor, mask: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """[T] the lag of every real token (mask 1) in row-major order."""
    real = versions[mask.bool()]
    if bool((real < 0).any()):
        raise ValueError("a response token has no recorded version (-1)")
    return trainer_version - real


def sequence_lags(versions: torch.Tensor, mask: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """[N] each sequence's largest lag (its oldest token); 0 for a row without real tokens."""
    oldest = torch.where(mask.bool(), versions, torch.iinfo(versions.dtype).max).min(-1).values
    return torch.where(mask.bool().any(-1), trainer_version - oldest, 0)


def newest_versions(versions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] each sequence's newest version (its last request's weights, which also computed the
    engine's routing of all its tokens); -1 for a row without real tokens."""
    return torch.where(mask.bool(), versions, -1).max(-1).values


def staleness_metrics(versions: torch.Tensor,  # [N, L] long, per token
                      mask: torch.Tensor,  # [N, L] response tokens
                      trainer_version: int,
                      old_logprobs: torch.Tensor,  # [N, L] the trainer's (proximal)
                      rollout_logprobs: torch.Tensor  # [N, L] the engine's (behaviour)
                      ) -> Dict[str, float]:
    lags = token_lags(versions, mask, trainer_version)
    gap = (old_logprobs - rollout_logprobs)[mask.bool()].abs().to(torch.float64)
    real = mask.bool()
    newest = newest_versions(versions, mask)
    oldest = trainer_version - sequence_lags(versions, mask, trainer_version)
    out = {"async/version_lag_mean": float(lags.double().mean()), "async/version_lag_max": int(lags.max()),
           "async/stale_token_fraction": float((lags > 0).double().mean()),
           "async/trainer_version": trainer_version,
           # responses sampled by more than one version: partial rollouts continued across a sync
           "async/mixed_version_samples": int((real.any(-1) & (newest != oldest)).sum())}
    for lag in torch.unique(lags).tolist():
        of_lag = gap[lags == lag]
        out[f"async/mismatch_lag{lag}_mean"] = float(of_lag.mean())
        out[f"async/mismatch_lag{lag}_max"] = float(of_lag.max())
    return out
