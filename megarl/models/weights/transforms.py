"""Named split/merge functions between HF tensors and Megatron's full (unsharded) tensors.

Pure functions of tensors and ints. Each merge has its split, and split(merge(x)) == x exactly:
they only copy and reorder values, so conversion round trips are bit-exact.
"""

from typing import List

import torch


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
              num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """HF q [Nq*D, ...], k/v [Nkv*D, ...] -> Megatron linear_qkv [(Nq + 2*Nkv)*D, ...], grouped per
    KV head: [q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...]. TP then shards whole
    groups, which is why Nkv must be divisible by tp."""
    per_group = num_heads // num_kv_heads
    rest = q.shape[1:]
    q = q.reshape(num_kv_heads, per_group * head_dim, *rest)
    k = k.reshape(num_kv_heads, head_dim, *rest)
    v = v.reshape(num_kv_heads, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> List[torch.Tensor]:
    per_group = num_heads // num_kv_heads
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_kv_heads, (per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return [q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous()]


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF gate [F, H], up [F, H] -> Megatron linear_fc1 [2F, H] (SwiGLU: silu(gate) * up)."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> List[torch.Tensor]:
    return [t.contiguous() for t in fc1.chunk(2, dim=0)]


def pad_vocab(weight: torch.Tensor, padded_size: int) -> torch.Tensor:
    """[V, H] -> [Vp, H]; padded rows are zero (their logits are dropped before any softmax)."""
    if padded_size < weight.shape[0]:
        raise ValueError(f"padded vocab {padded_size} is smaller than vocab {weight.shape[0]}")
    pad = weight.new_zeros(padded_size - weight.shape[0], *weight.shape[1:])
    return torch.cat([weight, pad], dim=0)


def unpad_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return weight[:vocab_size].contiguous()


def merge_gated_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
                    num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Gated attention (Qwen3-Next): HF q_proj [Nq*2*D, ...] holds each head's query then its
    output gate -> Megatron linear_qkv with attention_output_gate, per KV group
    [q heads, gate heads, k, v]."""
    per_group = num_heads // num_kv_heads
    rest = q.shape[1:]
    query, gate = q.reshape(num_heads, 2, head_dim, *rest).unbind(1)
    parts = [x.reshape(num_kv_heads, n * head_dim, *rest)
             for x, n in ((query, per_group), (gate, per_group), (k, 1), (v, 1))]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_gated_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                    head_dim: int) -> List[torch.Tensor]:
    per_group = num_heads // num_kv_heads
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_kv_heads, (2 * per_group + 2) * head_dim, *rest)
    query, gate, k, v = grouped.split([per_group * head_dim, per_group * head_dim, head_dim, head_dim], 1)
    q = torch.stack([x.reshape(num_heads, head_dim, *rest) for x in (query, gate)], dim=1)
    return [q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous()]


def merge_qkvzba(qkvz: torch.Tensor, ba: torch.Tensor, key_heads: int, value_heads: int,
                 key_dim: int, value_dim: int) -> torch.Tensor:
    """Gated DeltaNet: HF in_proj_qkvz [Nk * (2*Dk + 2*r*Dv), H] and in_proj_ba [Nk * 2r, H], both
    grouped per key head (r = Nv / Nk value heads each) -> Megatron in_proj
    [q | k | v | z | beta | alpha], each part over all heads in order."""
    r = value_heads // key_heads
    rest = qkvz.shape[1:]
    q, k, v, z = qkvz.reshape(key_heads, -1, *rest).split([key_dim, key_dim, r * value_dim,
                                                           r * value_dim], dim=1)
    b, a = ba.reshape(key_heads, 2 * r, *rest).split([r, r], dim=1)
    return torch.cat([x.reshape(-1, *rest) for x in (q, k, v, z, b, a)], dim=0)


def split_qkvzba(in_proj: torch.Tensor, key_heads: int, value_heads: int, key_dim: int,
                 value_dim: int) -> List[torch.Tensor]:
    rest = in_proj.shape[1:]
    qk, vd = key_heads * key_dim, value_heads * value_dim
    q, k, v, z, b, a = (x.reshape(key_heads, -1, *rest) for x in
                        in_proj.split([qk, qk, vd, vd, value_heads, value_heads], dim=0))
    return [torch.cat([q, k, v, z], dim=1).reshape(-1, *rest).contiguous(),
            torch.cat([b, a], dim=1).reshape(-1, *rest).contiguous()]


def merge_interleaved_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's one expert gate_up [H, 2F] (x @ W; columns gate, up, gate, up, ...) or its bias
    [2F] -> Megatron linear_fc1 [2F, H] (or [2F]): the gate rows, then the up rows."""
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    return torch.cat([gate, up], dim=-1).transpose(0, -1).contiguous()


def split_interleaved_gate_up(fc1: torch.Tensor) -> List[torch.Tensor]:
    gate, up = fc1.transpose(0, -1).chunk(2, dim=-1)
    return [torch.stack([gate, up], dim=-1).reshape(*gate.shape[:-1], -1).contiguous()]


def transpose(weight: torch.Tensor) -> torch.Tensor:
    """gpt-oss's one expert down [F, H] (x @ W) <-> Megatron linear_fc2 [H, F]; its own inverse."""
    return weight.transpose(0, 1).contiguous()
