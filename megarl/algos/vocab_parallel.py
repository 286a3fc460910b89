"""Log-probs of target tokens and entropy from vocabulary-sharded logits, without gathering V.

Owns the tensor-parallel log-softmax: TP rank r holds logits [N, V/tp] for the global vocab ids
[r * V/tp, (r + 1) * V/tp). A max all-reduce and one sum all-reduce of three per-token statistics
over the TP group replace the gather. Does not own the output layer or finding the group: the
caller passes the TP process group, or None when the vocabulary is not sharded (no communication;
None does not mean the default group here). Pass fp32 (or fp64) logits: nothing is upcast here.

Gradients follow Megatron's reduce-from-TP-region convention: the sum all-reduce passes gradients
through unchanged, because every TP rank computes the same loss from the reduced values; each rank
then gets the gradient of that loss with respect to its own shard. The reduced statistics are sums
of purely local terms (the shift is a detached constant), which is what makes this exact.
"""

from typing import Optional, Tuple

import torch
import torch.distributed as dist


class _SumOverShards(torch.autograd.Function):
    """All-reduce SUM forward, identity backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def logprobs_and_entropy(logits: torch.Tensor,  # [N, V/tp]
                         targets: torch.Tensor,  # [N] global vocab ids, < vocab_size
                         group: Optional[dist.ProcessGroup],
                         vocab_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target [N], entropy [N]) of softmax over the whole vocabulary. Columns
    with global id >= vocab_size (padding of the output layer) get probability 0; None means the
    shards hold no padding."""
    shard = logits.shape[-1]
    tp = 1 if group is None else dist.get_world_size(group)
    vocab_start = (0 if group is None else dist.get_rank(group)) * shard
    vocab_ids = torch.arange(vocab_start, vocab_start + shard, device=logits.device)  # [V/tp]
    real = vocab_ids < (shard * tp if vocab_size is None else vocab_size)  # [V/tp]
    # Any per-token constant works as the shift; the global max keeps exp() in range.
    shift = torch.where(real, logits.detach(), float("-inf")).amax(-1, keepdim=True)  # [N, 1]
    if group is not None:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    # Padding is 0 before exp() and 0 after it: finite everywhere, so no NaN in the backward.
    shifted = torch.where(real, logits - shift, 0)  # [N, V/tp]
    exp = torch.where(real, shifted.exp(), 0)  # [N, V/tp]
    local = targets - vocab_start  # [N]
    here = (local >= 0) & (local < shard)  # [N]
    target = shifted.gather(-1, local.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1)  # [N]
    stats = torch.stack([torch.where(here, target, 0), exp.sum(-1), (exp * shifted).sum(-1)], -1)
    if group is not None:
        stats = _SumOverShards.apply(stats, group)  # [N, 3]
    target, sum_exp, weighted = stats.unbind(-1)
    log_sum_exp = sum_exp.log()
    # log p_t = x_t - shift - log Z;  H = log Z - sum(e * (x - shift)) / Z with e = exp(x - shift).
    return target - log_sum_exp, log_sum_exp - weighted / sum_exp
