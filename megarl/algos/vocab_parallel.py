"""Log-probs of target tokens and entropy from vocabulary-sharded logits, without gathering V, in
memory bounded by a chunk of tokens.

Owns the tensor-parallel log-softmax: TP rank r holds logits [N, V/tp] for the global vocab ids
[r * V/tp, (r + 1) * V/tp). A max all-reduce and one sum all-reduce of three per-token statistics
over the TP group replace the gather. Does not own the output layer or finding the group: the
caller passes the TP process group, or None when the vocabulary is not sharded (no communication;
None does not mean the default group here).

Memory: the logits are read `chunk_tokens` rows at a time, upcast to fp32 (or kept in fp64) per
chunk, and only per-token statistics are kept for the backward, which recomputes each chunk's
softmax and writes that chunk's gradient. So beyond the caller's logits and their gradient (in the
logits' own dtype), at most a few [chunk_tokens, V/tp] fp32 temporaries exist at once: passing the
model's bf16 logits, the whole path holds less than the fp32 logits would, where autograd through
a full-width log-softmax held 6x them (docs/PERFORMANCE.md, "Log-prob memory").

Gradients follow Megatron's reduce-from-TP-region convention: every TP rank computes the same loss
from the reduced statistics, which are sums of purely local terms (the shift is a constant), so
each rank's gradient for its own shard is computed locally from the reduced statistics, exactly:
  d log p_t / dx_j = [j == t] - p_j,   dH / dx_j = -p_j (s_j - E_p[s]),   s = x - shift.
"""

from typing import Optional, Tuple

import torch
import torch.distributed as dist

# Rows of [tokens, V/tp] upcast at once: 1024 x 151,936 (Qwen3's vocabulary, unsharded) x 4 bytes
# is 0.6 GB a temporary, against 10 GB for the fp32 logits of a 16K-token micro-batch.
DEFAULT_CHUNK_TOKENS = 1024


def _shard(logits: torch.Tensor, group: Optional[dist.ProcessGroup], vocab_size: Optional[int]):
    """(first global vocab id of this shard, how many of its columns are real). The output layer's
    padding (global ids >= vocab_size) is a suffix of the vocabulary, so a shard's real columns
    are a prefix of it (none on a shard of padding only)."""
    shard = logits.shape[-1]
    tp = 1 if group is None else dist.get_world_size(group)
    vocab_start = (0 if group is None else dist.get_rank(group)) * shard
    vocab = shard * tp if vocab_size is None else vocab_size
    return vocab_start, min(max(vocab - vocab_start, 0), shard)


def _chunk_statistics(x: torch.Tensor,  # [c, real V/tp], a copy in the compute dtype (overwritten)
                      local: torch.Tensor,  # [c] target ids within this shard
                      group: Optional[dist.ProcessGroup]) -> torch.Tensor:  # [c, 4]
    """Per token: the shift (global max), log Z, the target's shifted logit and E_p[shifted]."""
    # Any per-token constant works as the shift; the global max keeps exp() in range.
    shift = x.amax(-1) if x.shape[-1] else x.new_full(x.shape[:1], float("-inf"))  # [c]
    if group is not None:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    x.sub_(shift[:, None])  # shifted, in place
    here = (local >= 0) & (local < x.shape[-1])  # [c]
    target = x.gather(-1, torch.where(here, local, 0)[:, None]).squeeze(-1) if x.shape[-1] \
        else x.new_zeros(x.shape[:1])  # [c]
    exp = x.exp()  # [c, real V/tp]: with x, the only [c, V] buffers
    sum_exp = exp.sum(-1)
    stats = torch.stack([torch.where(here, target, 0), sum_exp, exp.mul_(x).sum(-1)], -1)  # [c, 3]
    if group is not None:
        dist.all_reduce(stats, group=group)
    target, sum_exp, weighted = stats.unbind(-1)
    return torch.stack([shift, sum_exp.log(), target, weighted / sum_exp], -1)


class _ChunkedLogSoftmax(torch.autograd.Function):
    """(log p of each target, entropy) [N] from logits [N, V/tp]; see the module docstring."""

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size, chunk_tokens):
        compute = torch.promote_types(logits.dtype, torch.float32)
        vocab_start, real = _shard(logits, group, vocab_size)
        local = targets - vocab_start  # [N]
        stats = torch.cat([_chunk_statistics(logits[i:i + chunk_tokens, :real].to(compute, copy=True),
                                             local[i:i + chunk_tokens], group)
                           for i in range(0, logits.shape[0], chunk_tokens)]) \
            if logits.shape[0] else logits.new_zeros(0, 4, dtype=compute)  # [N, 4]
        _, log_z, target, mean_shifted = stats.unbind(-1)
        ctx.save_for_backward(logits, local, stats)
        ctx.chunk_tokens, ctx.real = chunk_tokens, real
        # log p_t = s_t - log Z;  H = log Z - E_p[s].
        return target - log_z, log_z - mean_shifted

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):  # [N], [N]
        logits, local, stats = ctx.saved_tensors
        step, real = ctx.chunk_tokens, ctx.real
        grad = torch.empty_like(logits)
        grad[:, real:] = 0  # the output layer's padding: probability 0
        for i in range(0, logits.shape[0], step):
            shift, log_z, _, mean_shifted = stats[i:i + step, :, None].unbind(1)  # [c, 1] each
            g_lp, g_h = grad_logprob[i:i + step, None], grad_entropy[i:i + step, None]  # [c, 1]
            s = logits[i:i + step, :real].to(stats.dtype, copy=True).sub_(shift)  # [c, real V/tp]
            p = (s - log_z).exp_()  # [c, real V/tp]: with s, the only [c, V] buffers
            chunk = s.sub_(mean_shifted).mul_(g_h).add_(g_lp).mul_(p).neg_()  # -p (g_lp + g_h (s - E[s]))
            at = local[i:i + step]
            here = (at >= 0) & (at < real)
            rows = torch.arange(at.shape[0], device=at.device)[here]
            chunk[rows, at[here]] += g_lp[here, 0]  # + g_lp at the target
            grad[i:i + step, :real] = chunk
        return grad, None, None, None, None


def working_bytes(tokens: int, vocab_shard: int, logits_bytes: int, backward: bool,
                  chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> int:
    """Pure: the most bytes logprobs_and_entropy allocates beyond the logits it is given [tokens,
    vocab_shard] of `logits_bytes` each: two [chunk, V/tp] temporaries in the compute dtype (the
    upcast copy and exp, then s and p in the backward), and with `backward` the logits' gradient
    in their own dtype (the memory planner's log-prob term, trainer/memory_plan.py)."""
    compute = max(logits_bytes, 4)
    chunk = 2 * min(chunk_tokens, tokens) * vocab_shard * compute
    return chunk + (tokens * vocab_shard * logits_bytes if backward else 0)


def logprobs_and_entropy(logits: torch.Tensor,  # [..., V/tp], any float dtype
                         targets: torch.Tensor,  # [...] global vocab ids, < vocab_size
                         group: Optional[dist.ProcessGroup],
                         vocab_size: Optional[int] = None,
                         chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target [...], entropy [...]) of softmax over the whole vocabulary, in
    fp32 (fp64 logits stay fp64). Columns with global id >= vocab_size (padding of the output
    layer) get probability 0; None means the shards hold no padding. Pass the model's logits as
    they are: upcasting them whole first is the memory this function avoids."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1 (rows of logits upcast at once)")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V/tp]
    logprob, entropy = _ChunkedLogSoftmax.apply(flat, targets.reshape(-1), group, vocab_size,
                                                chunk_tokens)
    return logprob.reshape(lead), entropy.reshape(lead)
