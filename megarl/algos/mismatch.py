"""How far the trainer's log-probs and MoE routing are from the rollout engine's, and where the
gap comes from: per token (KL estimators, quantiles of the log-prob difference), per sequence
(log-prob gap, perplexity ratio) and, for MoE models, per routed layer (top-k sets that differ).

Owns these statistics as pure functions of tensors. Does not own correcting for the gap
(rollout_correction.py) or where the routing comes from (megarl.actor.router_replay, the engine).
"""

from typing import Dict

import torch


def logprob_mismatch(old_logprobs: torch.Tensor,  # [B, T] the trainer's before the update
                     rollout_logprobs: torch.Tensor,  # [B, T] the engine's, for the same tokens
                     mask: torch.Tensor) -> Dict[str, float]:  # [B, T] real (response) tokens
    """Statistics over the real tokens; sequences without one are left out of the per-sequence
    ones. KL(rollout || old) is estimated from the engine's own samples: k1 = log(rollout / old),
    k3 = r - 1 - log r with r = old / rollout (unbiased, never negative)."""
    keep = mask.bool()
    diff = (old_logprobs - rollout_logprobs).to(torch.float64)  # log r
    tokens = diff[keep]
    if tokens.numel() == 0:
        raise ValueError("log-prob mismatch of a batch without real tokens (mask is all 0)")
    magnitude = tokens.abs()
    rows = keep.any(-1)
    seq_sum = torch.where(keep, diff, 0).sum(-1)[rows]
    seq_len = keep.sum(-1)[rows]
    return {
        "mismatch/kl_k1": float((-tokens).mean()),
        "mismatch/kl_k3": float((torch.exp(tokens) - 1 - tokens).mean()),
        "mismatch/logprob_diff_mean": float(magnitude.mean()),
        "mismatch/logprob_diff_p50": float(torch.quantile(magnitude, 0.5)),
        "mismatch/logprob_diff_p99": float(torch.quantile(magnitude, 0.99)),
        "mismatch/logprob_diff_max": float(magnitude.max()),
        # |log p_old(y) - log p_rollout(y)| of each whole response y
        "mismatch/seq_logprob_gap_mean": float(seq_sum.abs().mean()),
        "mismatch/seq_logprob_gap_max": float(seq_sum.abs().max()),
        # the trainer's perplexity over the engine's, per response: exp(mean log(rollout / old))
        "mismatch/ppl_ratio": float(torch.exp(-seq_sum / seq_len).mean()),
    }


def routing_mismatch(engine: torch.Tensor,  # [B, T, layers, k] expert ids, -1 where none
                     trainer: torch.Tensor) -> Dict[str, float]:  # [B, T, layers, k] alike
    """Where both routed a token through a layer: the fraction of (token, layer) pairs whose
    top-k expert sets differ, and the fraction of tokens with a different set in any layer."""
    if engine.shape != trainer.shape:
        raise ValueError(f"engine routing {tuple(engine.shape)} and trainer routing "
                         f"{tuple(trainer.shape)} must have the same shape [B, T, layers, k]")
    both = (engine >= 0).all(-1) & (trainer >= 0).all(-1)  # [B, T, layers]
    if not bool(both.any()):
        raise ValueError("no (token, layer) pair was routed by both the engine and the trainer")
    differ = (engine.sort(-1).values != trainer.sort(-1).values).any(-1) & both
    routed_tokens = both.any(-1)
    return {
        "routing/topk_diff_fraction": int(differ.sum()) / int(both.sum()),
        "routing/tokens_diff_fraction": int(differ.any(-1).sum()) / int(routed_tokens.sum()),
    }
