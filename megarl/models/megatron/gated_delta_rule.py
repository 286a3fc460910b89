"""The gated delta rule of Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5), in portable torch.

Owns the math as pure functions of tensors: the causal depthwise conv, the chunked gated delta
rule (the same recurrence as transformers' torch_chunk_gated_delta_rule and its per-token
torch_recurrent_gated_delta_rule), and running both over packed (thd) sequences so that the conv
and the recurrent state start afresh at every sequence boundary. Also which kernel computes the
rule: flash-linear-attention's when it is importable and the tensors are on a GPU, else these
functions (`rule_kernel`). Does not own the layer's projections, norm or parameters
(models/megatron/gated_delta_net.py).

Shapes: B batch, S sequence, H value heads (keys repeated to them), K key dim, V value dim,
C conv channels, T packed tokens.
"""

import importlib.util
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as flash-linear-attention computes it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv then SiLU: x [B, S, C], weight [C, W] -> [B, S, C]. Each position
    sees itself and the W-1 before it within its own row (zeros before the start)."""
    width = weight.shape[-1]
    out = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight[:, None, :], padding=width - 1,
                   groups=weight.shape[0])[..., :x.shape[1]]
    return F.silu(out).transpose(1, 2).to(x.dtype)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = 64, qk_l2norm: bool = True,
                           initial_state: Optional[torch.Tensor] = None,
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, chunked: q, k [B, S, H, K]; v [B, S, H, V]; g (log decay, <= 0) and
    beta [B, S, H] -> (out [B, S, H, V] in v's dtype, final state [B, H, K, V]).

    Per token: state = exp(g) * state; state += k (beta * (v - state^T k))^T; out = state^T q / sqrt(K).
    Within a chunk the updates are condensed by the UT transform (one triangular solve), across
    chunks the state is carried: S/chunk_size sequential steps instead of S. Computed in fp32,
    or fp64 when the inputs are fp64."""
    out_dtype = v.dtype
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (x.transpose(1, 2).to(dtype) for x in (q, k, v, g, beta))  # [B, H, S, ...]
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    batch, heads, length, key_dim = k.shape
    pad = (-length) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))  # padded tokens: no decay, no update
    chunks = (length + pad) // chunk_size
    q, k, v = (x.reshape(batch, heads, chunks, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, chunks, chunk_size) for x in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(dim=-1)  # [B, H, n, c]: log decay from the chunk's start
    later = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(later, float("-inf")).exp()
    # UT transform: (I + strictly-lower(k_beta k^T * decay))^-1 applied to v_beta and the decayed keys.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                      unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay  # [B, H, n, c, c]
    q_read = q * cum.exp()[..., None]  # what each query reads of the state carried in
    k_write = k * (cum[..., -1:] - cum).exp()[..., None]  # each key's decay to the chunk's end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]
    state = (torch.zeros(batch, heads, key_dim, v.shape[-1], dtype=dtype, device=q.device)
             if initial_state is None else initial_state.to(dtype))
    outs = []
    for i in range(chunks):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_read[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_write[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(batch, heads, chunks * chunk_size, -1)[:, :, :length]
    return out.transpose(1, 2).to(out_dtype).contiguous(), state


def fla_available() -> bool:
    """Whether flash-linear-attention (Triton, GPU only) is installed."""
    return importlib.util.find_spec("fla") is not None


def rule_kernel(device: torch.device) -> str:
    """'fla' when flash-linear-attention is installed and the tensors are on a GPU (Megatron-Core's
    GatedDeltaNet kernel), else 'torch' (this module's chunked rule): one choice, by availability,
    as the attention's backend is chosen."""
    return "fla" if device.type == "cuda" and fla_available() else "torch"


def length_groups(cu_seqlens: List[int]) -> List[Tuple[int, torch.Tensor]]:
    """The packed sequences by length: (length, token indices [count, length]) for each length;
    RL packs hold many sequences of few lengths, and each group runs as one batch."""
    bounds = torch.tensor(cu_seqlens)
    starts, lengths = bounds[:-1], bounds[1:] - bounds[:-1]
    return [(n, starts[lengths == n][:, None] + torch.arange(n))
            for n in lengths.unique().tolist() if n > 0]


def over_sequences(fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor],
                   cu_seqlens: List[int]) -> torch.Tensor:
    """Apply a per-sequence function fn(*[count, n, ...]) -> [count, n, ...] to every sequence of
    packs [T, ...] (each sequence its own row: nothing crosses a boundary) -> [T, -1]; tokens
    past cu_seqlens[-1] (padding) come back as zeros. The tokens are gathered once into length
    order and split into the groups (one gather, one cat in the backward), not sliced per group."""
    groups = length_groups(cu_seqlens)
    device = tensors[0].device
    order = torch.cat([index.reshape(-1) for _, index in groups]).to(device)
    sizes = [index.numel() for _, index in groups]
    parts = [t[order].split(sizes) for t in tensors]
    outs = [fn(*(part[i].reshape(index.shape[0], n, *part[i].shape[1:]) for part in parts))
            .reshape(index.numel(), -1) for i, (n, index) in enumerate(groups)]
    out = torch.cat(outs)
    return out.new_zeros(tensors[0].shape[0], out.shape[1]).index_copy(0, order, out)


def packed_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, cu_seqlens: List[int], chunk_size: int = 64,
                            qk_l2norm: bool = True) -> torch.Tensor:
    """The rule over a pack: q, k [T, H, K]; v [T, H, V]; g, beta [T, H] -> [T, H * V], the state
    zero at each sequence's start."""
    def rule(*rows):
        return chunk_gated_delta_rule(*rows, chunk_size=chunk_size, qk_l2norm=qk_l2norm)[0]

    return over_sequences(rule, (q, k, v, g, beta), cu_seqlens)


def packed_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: List[int]) -> torch.Tensor:
    """The conv over a pack x [T, C] -> [T, C], zeros before each sequence's start."""
    return over_sequences(lambda rows: causal_conv1d(rows, weight), (x,), cu_seqlens)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, cu_seqlens: List[int]) -> torch.Tensor:
    """The rule over a pack by the kernel rule_kernel chooses: q, k [T, H, K] (not yet
    l2-normalized); v [T, H, V]; g, beta [T, H] -> [T, H * V]."""
    if rule_kernel(q.device) == "torch":
        return packed_gated_delta_rule(q, k, v, g, beta, cu_seqlens)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

    used = cu_seqlens[-1]  # fla takes the sequences' tokens only; padding after them gets zeros
    out, _ = fla_rule(*(x[None, :used] for x in (q, k, v)), g=g[None, :used], beta=beta[None, :used],
                      cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.long, device=q.device),
                      use_qk_l2norm_in_kernel=True)
    out = out[0].reshape(used, -1)
    return torch.cat([out, out.new_zeros(q.shape[0] - used, out.shape[1])])
