"""Loss aggregation: per-token loss [b, T] -> this micro-batch's share of the global-batch loss.

Owns the aggregation modes and their registry. Each mode is a sum over sequences (or tokens)
divided by global constants, so the share of a micro-batch is its own partial sum over those
constants, and the shares summed over all micro-batches and data-parallel ranks equal the mode's
value on the whole global batch, however it was split. Two consequences for the caller:
  - `global_tokens` (real tokens) and `global_seqs` (sequences, empty ones included) count the
    whole global batch, e.g. a mask sum all-reduced over DP; a 0-dim tensor avoids a host sync;
  - gradients must be summed, not averaged, over micro-batches and DP ranks (scale by the DP size
    where the DDP wrapper averages).
A micro-batch holds whole sequences: "seq-mean-token-mean" counts each row's tokens locally.
Does not own the all-reduce of the counts or the backward.
"""

from typing import Callable, Dict, Union

import torch

from megarl.algos import pick

Count = Union[int, float, torch.Tensor]


def _token_mean(masked: torch.Tensor, weight: torch.Tensor, global_tokens: Count,
                global_seqs: Count, max_len: int) -> torch.Tensor:
    """Mean over all real tokens of the global batch: every token weighs the same."""
    return masked.sum() / global_tokens


def _seq_mean_token_sum(masked: torch.Tensor, weight: torch.Tensor, global_tokens: Count,
                        global_seqs: Count, max_len: int) -> torch.Tensor:
    """Mean over sequences of each sequence's token sum."""
    return masked.sum() / global_seqs


def _seq_mean_token_mean(masked: torch.Tensor, weight: torch.Tensor, global_tokens: Count,
                         global_seqs: Count, max_len: int) -> torch.Tensor:
    """Mean over sequences of each sequence's token mean (an empty sequence contributes 0)."""
    return (masked.sum(-1) / weight.sum(-1).clamp(min=1)).sum() / global_seqs


def _seq_mean_token_sum_norm(masked: torch.Tensor, weight: torch.Tensor, global_tokens: Count,
                             global_seqs: Count, max_len: int) -> torch.Tensor:
    """Mean over sequences of each sequence's token sum / max_len (Dr. GRPO's constant)."""
    return masked.sum() / max_len / global_seqs


AGGREGATIONS: Dict[str, Callable[..., torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(per_token_loss: torch.Tensor,  # [b, T], b sequences of this micro-batch
              mask: torch.Tensor,  # [b, T]
              mode: str, global_tokens: Count, global_seqs: Count, max_len: int) -> torch.Tensor:
    """This micro-batch's scalar share of the `mode` loss of the global batch."""
    keep = mask.bool()
    masked = torch.where(keep, per_token_loss, 0)
    return pick(AGGREGATIONS, mode, "loss aggregation")(masked, keep.to(masked.dtype), global_tokens,
                                                        global_seqs, max_len)
