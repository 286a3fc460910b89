"""Log-probs of target tokens and entropy from vocabulary-sharded logits, without gathering V and
without fp32 copies of [tokens, V].

Owns the tensor-parallel log-softmax: TP rank r holds logits [N, V/tp] for the global vocab ids
[r * V/tp, (r + 1) * V/tp). Each rank reduces its shard to four numbers per token, relative to its
own max (that max, sum e^(x - m), sum e^(x - m)(x - m), the target's x - m); one max all-reduce and
one sum all-reduce over the TP group combine them exactly (a rank's sums rescale by e^(m_r - M)).
Does not own the output layer or finding the group: the caller passes the TP process group, or
None when the vocabulary is not sharded (no communication; None does not mean the default group).

Two passes over [N, V/tp] make up the head, each one fused kernel: the forward's reduction (it
reads the logits twice inside one kernel: the max, then the sums) and the backward, which reads
them once more and writes the gradient in the logits' dtype. Nothing [N, V] is kept for the
backward: only the per-token statistics. The kernels (`KERNELS`):
  compiled  torch.compile (Inductor) of the two functions below, all tokens at once: Triton on a
            GPU, C++ on a CPU. Nothing [N, V] is materialized but the gradient. The GPU's choice.
  eager     op by op over chunks of at most 1/8 of the tokens: the forward's function as it is,
            the backward in place; two fp32 [chunk, V/tp] buffers at a time. The CPU's choice:
            megarl's CPU runs (tests, the demo) have small vocabularies, where the compile (seconds
            per process) costs more than it saves (docs/PERFORMANCE.md, "Log-prob head").
Gradients follow Megatron's reduce-from-TP-region convention: every TP rank computes the same loss
from the reduced statistics, so each rank's gradient for its own shard is computed locally:
  d log p_t / dx_j = [j == t] - p_j,   dH / dx_j = -p_j (s_j - E_p[s]),   s = x - shift.
When the loss does not use the entropy (`entropy_grad=False`) its gradient term is not computed.
"""

import functools
import math
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

# The eager kernels' chunk: at most this many rows of [tokens, V/tp] in fp32 at once (1024 x 151,936,
# Qwen3's vocabulary, is 0.6 GB a temporary), and at least EAGER_MIN_CHUNKS chunks, so the
# temporaries stay a fraction of the logits whatever the number of tokens.
DEFAULT_CHUNK_TOKENS = 1024
EAGER_MIN_CHUNKS = 8
# fp32 [chunk, V/tp] buffers the eager kernels hold at once: the forward's upcast copy and its exp;
# the backward's upcast copy and p.
EAGER_TEMPORARIES = 2


def _local_statistics(x: torch.Tensor,  # [c, R] this shard's real columns, any float dtype
                      local: torch.Tensor  # [c] target ids within this shard
                      ) -> torch.Tensor:  # [c, 4] in the compute dtype
    """Per token, relative to this shard's max m: (m, sum e^(x-m), sum e^(x-m) (x-m), x_t - m or 0
    where the target is on another shard)."""
    s = x.to(torch.promote_types(x.dtype, torch.float32), copy=True)  # [c, R]
    m = s.amax(-1)  # [c]
    s.sub_(m[:, None])
    here = (local >= 0) & (local < x.shape[-1])  # [c]
    target = torch.where(here, s.gather(-1, torch.where(here, local, 0)[:, None]).squeeze(-1), 0.0)
    e = s.exp()  # [c, R]
    return torch.stack([m, e.sum(-1), e.mul_(s).sum(-1), target], -1)


def _gradient(x: torch.Tensor,  # [c, W] the shard, padding columns included
              local: torch.Tensor,  # [c]
              real: int,  # columns [real, W) are the output layer's padding: probability 0
              shift: torch.Tensor, log_z: torch.Tensor, mean_s: torch.Tensor,  # [c] each
              g_lp: torch.Tensor,  # [c] d loss / d log p_t
              g_h: Optional[torch.Tensor]  # [c] d loss / d H, None when the loss has no entropy
              ) -> torch.Tensor:  # [c, W] in x's dtype
    """d loss / d x = g_lp ([j == t] - p_j) - g_h p_j (s_j - E_p[s]), one pointwise expression
    (the compiled kernel: every term fuses into one pass that writes the gradient)."""
    s = x.to(shift.dtype) - shift[:, None]  # [c, W]
    p = (s - log_z[:, None]).exp()
    scale = g_lp[:, None] if g_h is None else g_lp[:, None] + g_h[:, None] * (s - mean_s[:, None])
    col = torch.arange(x.shape[-1], device=x.device)[None, :]  # [1, W]
    grad = torch.where(col == local[:, None], g_lp[:, None], 0.0) - p * scale
    return torch.where(col < real, grad, 0.0).to(x.dtype)


def _gradient_in_place(out: torch.Tensor,  # [c, real] the gradient's rows and real columns, written
                       x: torch.Tensor,  # [c, real]
                       local: torch.Tensor, shift: torch.Tensor, log_z: torch.Tensor,
                       mean_s: torch.Tensor, g_lp: torch.Tensor, g_h: Optional[torch.Tensor]) -> None:
    """_gradient op by op in two fp32 [c, real] buffers (the eager kernel: each op is a pass, so
    the fewest buffers, not the fewest ops)."""
    s = x.to(shift.dtype, copy=True).sub_(shift[:, None])
    p = (s - log_z[:, None]).exp_()
    if g_h is None:
        grad = p.mul_(-g_lp[:, None])
    else:  # -p (g_lp + g_h (s - E[s]))
        grad = s.sub_(mean_s[:, None]).mul_(g_h[:, None]).add_(g_lp[:, None]).mul_(p).neg_()
    here = (local >= 0) & (local < x.shape[-1])
    grad.scatter_add_(1, torch.where(here, local, 0)[:, None], torch.where(here, g_lp, 0.0)[:, None])
    out.copy_(grad)


class EagerKernels:
    """The two passes op by op over chunks of tokens: fp32 temporaries of a chunk at a time."""
    name, chunked = "eager", True

    @staticmethod
    def chunk_rows(tokens: int, chunk_tokens: int) -> int:
        return max(1, min(chunk_tokens, math.ceil(tokens / EAGER_MIN_CHUNKS)))

    def statistics(self, x: torch.Tensor, local: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        step = self.chunk_rows(x.shape[0], chunk_tokens)
        return torch.cat([_local_statistics(x[i:i + step], local[i:i + step])
                          for i in range(0, x.shape[0], step)])

    def gradient(self, logits, local, real, shift, log_z, mean_s, g_lp, g_h, chunk_tokens: int):
        grad = torch.empty_like(logits)
        grad[:, real:] = 0  # the output layer's padding: probability 0
        step = self.chunk_rows(logits.shape[0], chunk_tokens)
        for i in range(0, logits.shape[0] if real else 0, step):
            rows = slice(i, i + step)
            _gradient_in_place(grad[rows, :real], logits[rows, :real], local[rows], shift[rows],
                               log_z[rows], mean_s[rows], g_lp[rows], None if g_h is None else g_h[rows])
        return grad


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable) -> Callable:
    # dynamic: one kernel for every number of tokens and vocabulary shard width (packs vary).
    return torch.compile(fn, dynamic=True, fullgraph=True)


class CompiledKernels:
    """The two passes as two fused kernels (Inductor: Triton on a GPU, C++ on a CPU), all tokens at
    once: nothing [N, V] is materialized but the gradient."""
    name, chunked = "compiled", False

    @staticmethod
    def chunk_rows(tokens: int, chunk_tokens: int) -> int:
        return max(tokens, 1)

    def statistics(self, x: torch.Tensor, local: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        return _compiled(_local_statistics)(x, local)

    def gradient(self, logits, local, real, shift, log_z, mean_s, g_lp, g_h, chunk_tokens: int):
        return _compiled(_gradient)(logits, local, real, shift, log_z, mean_s, g_lp, g_h)


EAGER, COMPILED = EagerKernels(), CompiledKernels()
KERNELS = {k.name: k for k in (EAGER, COMPILED)}


def kernels_for(device: torch.device):
    """The kernels a device runs by default: compiled on a GPU, eager on a CPU (module docstring)."""
    return COMPILED if torch.device(device).type != "cpu" else EAGER


def _shard(logits: torch.Tensor, group: Optional[dist.ProcessGroup], vocab_size: Optional[int]):
    """(first global vocab id of this shard, how many of its columns are real). The output layer's
    padding (global ids >= vocab_size) is a suffix of the vocabulary, so a shard's real columns
    are a prefix of it (none on a shard of padding only)."""
    shard = logits.shape[-1]
    tp = 1 if group is None else dist.get_world_size(group)
    vocab_start = (0 if group is None else dist.get_rank(group)) * shard
    vocab = shard * tp if vocab_size is None else vocab_size
    return vocab_start, min(max(vocab - vocab_start, 0), shard)


def _combine(local_stats: torch.Tensor,  # [N, 4] this shard's, relative to its own max
             here: torch.Tensor,  # [N] whether the target is on this shard
             group: Optional[dist.ProcessGroup]) -> torch.Tensor:  # [N, 4]
    """(shift, log Z, E_p[s], log p_t) over the whole vocabulary, relative to the global max M =
    shift: every rank's sums rescaled by e^(m_r - M) (sum e^(x-M) (x-M) = e^(m_r-M) (W_r + (m_r -
    M) Z_r)), then summed."""
    m, z, w, target = local_stats.unbind(-1)
    shift = m.clone()
    if group is not None:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    delta = m - shift  # -inf on a shard of padding only, whose sums are 0
    scale = delta.exp()
    has = z > 0
    sums = torch.stack([z * scale, torch.where(has, (w + delta * z) * scale, 0.0),
                        torch.where(here, target + delta, 0.0)], -1)  # [N, 3]
    if group is not None:
        dist.all_reduce(sums, group=group)
    z, w, target = sums.unbind(-1)
    log_z = z.log()
    return torch.stack([shift, log_z, w / z, target - log_z], -1)


class _ChunkedLogSoftmax(torch.autograd.Function):
    """(log p of each target, entropy) [N] from logits [N, V/tp]; see the module docstring."""

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size, chunk_tokens, kernels, entropy_grad):
        compute = torch.promote_types(logits.dtype, torch.float32)
        vocab_start, real = _shard(logits, group, vocab_size)
        local = targets - vocab_start  # [N]
        if real and logits.shape[0]:
            local_stats = kernels.statistics(logits[:, :real], local, chunk_tokens)
        else:  # no tokens, or a shard of the output layer's padding only: no probability here
            local_stats = logits.new_zeros(logits.shape[0], 4, dtype=compute)
            local_stats[:, 0] = float("-inf")
        stats = _combine(local_stats, (local >= 0) & (local < real), group)  # [N, 4]
        shift, log_z, mean_s, logprob = stats.unbind(-1)
        ctx.save_for_backward(logits, local, stats)
        ctx.args = (real, kernels, entropy_grad, chunk_tokens)
        entropy = log_z - mean_s  # H = log Z - E_p[s]
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):  # [N], [N]
        logits, local, stats = ctx.saved_tensors
        real, kernels, entropy_grad, chunk_tokens = ctx.args
        shift, log_z, mean_s, _ = stats.unbind(-1)
        # contiguous: a loss like lp.sum() hands back an expanded (stride 0) gradient, which the
        # compiled kernel would be built again for
        g_h = grad_entropy.to(stats.dtype).contiguous() if entropy_grad else None
        grad = kernels.gradient(logits, local, real, shift, log_z, mean_s,
                                grad_logprob.to(stats.dtype).contiguous(), g_h, chunk_tokens)
        return grad, None, None, None, None, None, None


@torch.no_grad()
def top1_match(logits: torch.Tensor,  # [N, V/tp], any float dtype
               targets: torch.Tensor,  # [N] global vocab ids, < vocab_size
               group: Optional[dist.ProcessGroup],
               vocab_size: Optional[int] = None) -> torch.Tensor:  # [N] bool
    """Whether each target is the most likely token over the whole vocabulary (a tie counts), the
    output layer's padding excluded, from vocab-parallel shards: one max and one sum all-reduce of
    [N] each, nothing of [N, V] gathered."""
    vocab_start, real = _shard(logits, group, vocab_size)
    local = targets - vocab_start
    here = (local >= 0) & (local < real)
    top = logits[:, :real].amax(-1).float() if real else logits.new_full(targets.shape, float("-inf"),
                                                                      dtype=torch.float32)
    rows = torch.arange(len(targets), device=logits.device)
    target = torch.where(here, logits[rows, local.clamp(0, max(real - 1, 0))].float(), 0.0)
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(target, group=group)
    return target >= top


def working_bytes(tokens: int, vocab_shard: int, logits_bytes: int, backward: bool,
                  device: str = "cuda", chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> int:
    """Pure: the most bytes logprobs_and_entropy allocates beyond the logits it is given [tokens,
    vocab_shard] of `logits_bytes` each, with the kernels `device` runs (kernels_for): with
    `backward`, the logits' gradient in their own dtype; the per-token statistics; and the eager
    kernels' fp32 [chunk, V/tp] buffers (the memory planner's log-prob term, planning/memory_plan.py)."""
    kernels = kernels_for(torch.device(device))
    compute = max(logits_bytes, 4)
    statistics = tokens * 8 * compute  # [N, 4] local, [N, 4] combined
    gradient = tokens * vocab_shard * logits_bytes if backward else 0
    chunk = EAGER_TEMPORARIES * kernels.chunk_rows(tokens, chunk_tokens) * vocab_shard * compute \
        if kernels.chunked else 0
    return gradient + statistics + chunk


def logprobs_and_entropy(logits: torch.Tensor,  # [..., V/tp], any float dtype
                         targets: torch.Tensor,  # [...] global vocab ids, < vocab_size
                         group: Optional[dist.ProcessGroup],
                         vocab_size: Optional[int] = None,
                         chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                         kernels: Optional[str] = None,
                         entropy_grad: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target [...], entropy [...]) of softmax over the whole vocabulary, in
    fp32 (fp64 logits stay fp64). Columns with global id >= vocab_size (padding of the output
    layer) get probability 0; None means the shards hold no padding. Pass the model's logits as
    they are: upcasting them whole first is the memory this function avoids. `kernels`: a name in
    KERNELS, None for the device's (kernels_for). `entropy_grad=False`: the entropy is returned
    without a gradient (a loss without an entropy term), and its gradient terms are not computed."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1 (rows of logits upcast at once)")
    if kernels is not None and kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}: choose one of {sorted(KERNELS)} (None: the device's)")
    chosen = KERNELS[kernels] if kernels else kernels_for(logits.device)
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V/tp]
    logprob, entropy = _ChunkedLogSoftmax.apply(flat, targets.reshape(-1), group, vocab_size,
                                                chunk_tokens, chosen, entropy_grad)
    return logprob.reshape(lead), entropy.reshape(lead)
