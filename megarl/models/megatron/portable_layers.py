"""Layers of megarl's portable spec: what Megatron-Core's local spec lacks when Transformer
Engine is absent (CPU here, or a GPU box without TE).

Owns: an RMSNorm that supports sequence parallelism, and a core attention that supports context
parallelism and packed (thd) sequences (Megatron's WrappedTorchNorm refuses the first, its
DotProductAttention the other two).
Does not own the rest of the layer: linears, MoE and RoPE stay Megatron-Core's own modules.
"""

import math

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from megarl.parallel_state import megatron_groups


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, as Hugging Face models do.

    Under sequence parallelism each TP rank normalizes a different slice of the sequence, so the
    weight's gradient is partial per rank; `sequence_parallel=True` tells Megatron's
    finalize_model_grads to all-reduce it over the TP group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.eps = eps
        # Zero-centered (Qwen3-Next's): scale by (1 + weight), applied in fp32 before the cast,
        # as its HF model does.
        self.zero_centered = config.layernorm_zero_centered_gamma
        self.weight = torch.nn.Parameter((torch.zeros if self.zero_centered else torch.ones)(
            hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x):  # [..., H]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


class ExpertRowParallelLinear(tensor_parallel.RowParallelLinear):
    """Megatron's, for experts' biases (gpt-oss). The output is its own tensor where the TP
    reduction is the identity (expert TP 1 without EP): Megatron's biased experts add the weighted
    bias in place (transformer/mlp.py), which autograd refuses on the reduction's pass-through
    view. An expert's bias is not sequence-parallel: its tokens all reach its rank, so its
    gradient is whole there; Megatron marks it sequence-parallel, and finalize_model_grads then
    summed it with another expert's over the TP group (measured at TP2 x EP2)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.is_expert and self.bias is not None:
            self.bias.sequence_parallel = False

    def forward(self, input_):
        output, bias = super().forward(input_)
        if self.is_expert and not self.explicit_expert_comm and bias is not None:
            output = output.clone()
        return output, bias


class _GatherFromContextParallel(torch.autograd.Function):
    """All-gather along dim 0 over the CP group; backward sums every rank's gradient and keeps
    this rank's slice (all-reduce instead of reduce-scatter keeps it portable to any backend)."""

    @staticmethod
    def forward(ctx, x, group):  # x: [s/cp, ...] -> [s, ...] in CP-rank order
        ctx.group = group
        world = dist.get_world_size(group)
        out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(world, dim=0)[rank], None


def gather_from_context_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """[s/cp, ...] -> [s, ...] in CP-rank order; the backward sums all ranks' gradients and keeps
    this rank's slice."""
    return _GatherFromContextParallel.apply(x, group)


def cp_positions(local_len: int, cp_rank: int, cp_size: int, device) -> torch.Tensor:
    """Global token positions held by one CP rank: chunks r and 2*cp-1-r of 2*cp chunks."""
    chunk = local_len // 2
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, torch.arange(last_start, last_start + chunk, device=device)])


class PortableCoreAttention(MegatronModule):
    """Causal softmax attention over padded [s, b, heads, d] or packed thd [t, heads, d] inputs
    (block-diagonal: a token sees earlier tokens of its own sequence), with context parallelism
    by all-gathering keys and values over the CP group (the "all-gather" CP scheme: memory grows
    with the full sequence's K/V, compute stays local to this rank's queries)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None, k_channels=None, v_channels=None):
        # k_channels / v_channels: MLA's query-key and value head widths differ; the shapes of
        # the inputs carry them, and MLA passes its own softmax_scale.
        super().__init__(config=config)
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_group = (pg_collection.cp if pg_collection is not None and
                         hasattr(pg_collection, "cp") else megatron_groups.context().group)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        # Padded: query [sq, b, nq/tp, d]; key, value [sk, b, nkv/tp, d].
        # Packed (thd): query [t/cp, nq/tp, d]; key, value [t/cp, nkv/tp, d].
        if attention_bias is not None:
            raise NotImplementedError("the portable attention takes no attention bias")
        packed = packed_seq_params is not None
        if packed:
            if packed_seq_params.qkv_format != "thd":
                raise NotImplementedError(f"packed format {packed_seq_params.qkv_format!r}; "
                                          "megarl packs sequences as 'thd'")
            query, key, value = query[:, None], key[:, None], value[:, None]
        cp_size = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        cp_rank = dist.get_rank(self.cp_group) if cp_size > 1 else 0
        if cp_size > 1:
            key = gather_from_context_parallel(key, self.cp_group)
            value = gather_from_context_parallel(value, self.cp_group)
        if packed:
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            if cp_size == 1:
                return self._per_sequence(query[:, 0], key[:, 0], value[:, 0], cu.tolist())
            q_seg, q_pos = packed_positions(cu, cp_rank, cp_size)
            k_seg, k_pos = (torch.cat(parts) for parts in zip(
                *[packed_positions(cu, r, cp_size) for r in range(cp_size)]))
            allowed = (q_seg[:, None] == k_seg[None, :]) & self._mask(q_pos, k_pos)
        else:
            q_pos = cp_positions(query.shape[0], cp_rank, cp_size, query.device) if cp_size > 1 \
                else torch.arange(query.shape[0], device=query.device)
            k_pos = torch.cat([cp_positions(query.shape[0], r, cp_size, query.device)
                               for r in range(cp_size)]) if cp_size > 1 else q_pos
            allowed = self._mask(q_pos, k_pos)  # [sq, sk]
        q = query.permute(1, 2, 0, 3)  # [b, nq, sq, d]
        k = key.permute(1, 2, 0, 3).repeat_interleave(self.heads_per_group, dim=1)
        v = value.permute(1, 2, 0, 3).repeat_interleave(self.heads_per_group, dim=1)
        out = self._attend(q, k, v, allowed.to(q.device))  # [b, nq, sq, d]
        sq, b = query.shape[0], query.shape[1]
        out = out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # [sq, b, nq/tp * d]
        return out[:, 0] if packed else out

    def _mask(self, q_pos, k_pos):
        """[sq, sk]: which keys each query sees, by position in its sequence (causal)."""
        return k_pos[None, :] <= q_pos[:, None]

    def _attend(self, q, k, v, allowed):
        """q [B, nq, sq, d], k/v [B, nq, sk, d]; `allowed` [sq, sk], None: causal over one sequence."""
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, is_causal=allowed is None,
            dropout_p=self.dropout if self.training else 0.0, scale=self.softmax_scale)

    def _per_sequence(self, query, key, value, bounds):
        """Causal attention within each packed sequence (query [t, nq, d]; key, value [t, nkv, d]):
        sum(n_i^2) work like varlen flash attention, not the t^2 of one block-diagonal mask,
        which made packing cost as much attention as padding. Sequences of one length go through
        one batched call: RL packs hold many sequences of few lengths. The tokens are gathered
        once into length order and split into the batches (one gather, and a split whose backward
        is one cat), not sliced per sequence or per batch: each slice's backward allocates a
        gradient the size of the whole pack. Each batch row is computed as its own call computes
        it (fuzzed bit for bit in tests/test_portable_attention.py)."""
        bounds = torch.tensor(bounds)
        starts, lengths = bounds[:-1], bounds[1:] - bounds[:-1]
        batches, order = [], []  # (length, sequences) of each batch; the tokens in batch order
        for n in lengths.unique().tolist():
            if n > 0:
                firsts = starts[lengths == n]
                batches.append((n, len(firsts)))
                order.append((firsts[:, None] + torch.arange(n)).reshape(-1))
        order = torch.cat(order).to(query.device)
        sizes = [n * count for n, count in batches]
        outs = []
        for (n, count), q, k, v in zip(batches, *(x[order].split(sizes) for x in (query, key, value))):
            q, k, v = (x.view(count, n, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))  # [B, heads, n, d]
            k, v = (x.repeat_interleave(self.heads_per_group, dim=1) for x in (k, v))
            out = self._attend(q, k, v, None)  # [B, nq, n, dv]
            outs.append(out.transpose(1, 2).reshape(count * n, out.shape[1], out.shape[3]))
        out = torch.cat(outs)
        out = out.new_zeros(query.shape[0], *out.shape[1:]).index_copy(0, order, out)
        return out.reshape(out.shape[0], -1)  # [t, nq/tp * dv]

def packed_positions(cu_seqlens_padded: torch.Tensor, cp_rank: int, cp_size: int):
    """(sequence id, position in its sequence) of each token one CP rank holds of a thd pack
    [t/cp], in the rank's order: per sequence, its chunks r and 2cp-1-r."""
    bounds = cu_seqlens_padded.tolist()
    segments, positions = [], []
    for seq, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        local = (end - start) // cp_size
        pos = cp_positions(local, cp_rank, cp_size, None) if cp_size > 1 else torch.arange(local)
        positions.append(pos)
        segments.append(torch.full((local,), seq))
    return torch.cat(segments), torch.cat(positions)
