"""Where the Gated DeltaNet hybrids' own tensors go (Qwen3-Next): their full shapes, and the rows of
Megatron's fused tensors each HF tensor is made of. Pure functions of the architecture, used by
destination.py beside the other families' rules.

Megatron's in_proj is [q | k | v | z | beta | alpha] over all heads in order; HF's in_proj_qkvz
and in_proj_ba group them per key head (weight transforms merge_qkvzba). The gated attention's
linear_qkv is, per KV group, [q heads, gate heads, k, v]; HF's q_proj interleaves each head's
query and gate (merge_gated_qkv).
"""

from typing import List, Optional, Tuple

from megarl.models.hf.config import ModelArch


def hybrid_shape(arch: ModelArch, canonical: str) -> Optional[Tuple[int, ...]]:
    """The full shape of a hybrid's own tensor, None for the tensors every family has."""
    h, nv = arch.hidden_size, arch.linear_value_heads
    qk, vd = arch.linear_key_heads * arch.linear_key_dim, nv * arch.linear_value_dim
    table = (("self_attention.in_proj.weight", (2 * qk + 2 * vd + 2 * nv, h)),
             ("self_attention.conv1d.weight", (2 * qk + vd, 1, arch.linear_conv_kernel)),
             ("self_attention.dt_bias", (nv,)), ("self_attention.A_log", (nv,)),
             ("self_attention.out_norm.weight", (arch.linear_value_dim,)),
             ("self_attention.out_proj.weight", (h, vd)),
             ("mlp.shared_experts.gate_weight", (1, h)),
             ("self_attention.linear_qkv.weight",  # with the output gate's rows
              ((2 * arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim, h)))
    return next((shape for suffix, shape in table if canonical.endswith(suffix)), None)


def gated_qkv_rows(arch: ModelArch) -> List[List[Tuple[int, int, int]]]:
    """(full start, HF start, length) runs of HF q_proj, k_proj, v_proj in Megatron's linear_qkv."""
    d, per_group = arch.head_dim, arch.num_heads // arch.num_kv_heads
    group = (2 * per_group + 2) * d
    q = []
    for head in range(arch.num_heads):
        start = (head // per_group) * group + (head % per_group) * d
        q += [(start, 2 * head * d, d), (start + per_group * d, 2 * head * d + d, d)]
    k = [(g * group + 2 * per_group * d, g * d, d) for g in range(arch.num_kv_heads)]
    v = [(g * group + (2 * per_group + 1) * d, g * d, d) for g in range(arch.num_kv_heads)]
    return [q, k, v]


def qkvzba_rows(arch: ModelArch) -> List[List[Tuple[int, int, int]]]:
    """(full start, HF start, length) runs of HF in_proj_qkvz and in_proj_ba in Megatron's in_proj."""
    nk, nv, dk, dv = (arch.linear_key_heads, arch.linear_value_heads, arch.linear_key_dim,
                      arch.linear_value_dim)
    r, qk, vd = nv // nk, nk * dk, nv * dv
    per = 2 * dk + 2 * r * dv
    qkvz, ba = [], []
    for g in range(nk):
        qkvz += [(g * dk, g * per, dk), (qk + g * dk, g * per + dk, dk),
                 (2 * qk + g * r * dv, g * per + 2 * dk, r * dv),
                 (2 * qk + vd + g * r * dv, g * per + 2 * dk + r * dv, r * dv)]
        ba += [(2 * qk + 2 * vd + g * r, 2 * g * r, r), (2 * qk + 2 * vd + nv + g * r, 2 * g * r + r, r)]
    return [qkvz, ba]


# Split over vLLM's TP ranks by heads, each part apart (its mamba_v2_sharded_weight_loader for the
# conv's [q, k, v]; sharded_weight_loader(0) for the per-head decay parameters).
HEAD_SPLIT = ("self_attention.conv1d.weight", "self_attention.dt_bias", "self_attention.A_log")

Runs = List[Tuple[int, int, int]]


def _local(runs: Runs, keep) -> Runs:
    """The runs `keep` selects, written one after another from 0."""
    out, dst = [], 0
    for start, _, n in (run for i, run in enumerate(runs) if keep(i)):
        out.append((start, dst, n))
        dst += n
    return out


def vllm_tensors(arch: ModelArch, transform: str, canonical: str, names: Tuple[str, ...],
                 shape: Tuple[int, ...], tp: int, t: int,
                 q_heads: range, kv_heads: range) -> Optional[List[Tuple[str, Tuple[int, ...], Runs]]]:
    """(vLLM parameter name, shape, (full start, start, length) runs along dim 0) of a hybrid's
    tensor on vLLM TP rank t, None for the tensors every family has. vLLM's Qwen3-Next keeps HF's
    grouped layouts (in_proj_qkvz, in_proj_ba: the rank's key-head groups; qkv_proj's q part: HF
    q_proj's rows of the rank's heads, each query then its gate)."""
    if transform == "gated_qkv":
        d = arch.head_dim
        q, k, v = gated_qkv_rows(arch)
        runs = (_local(q, lambda i: i // 2 in q_heads) +
                [(s, 2 * len(q_heads) * d + dst, n) for s, dst, n in _local(k, lambda i: i in kv_heads)] +
                [(s, (2 * len(q_heads) + len(kv_heads)) * d + dst, n)
                 for s, dst, n in _local(v, lambda i: i in kv_heads)])
        return [(names[0].replace("q_proj", "qkv_proj"), ((2 * len(q_heads) + 2 * len(kv_heads)) * d,
                                                          *shape[1:]), runs)]
    if transform == "qkvzba":
        groups = range(t * arch.linear_key_heads // tp, (t + 1) * arch.linear_key_heads // tp)
        out = []
        for name, runs, per_group in zip(names, qkvzba_rows(arch), (4, 2)):
            mine = _local(runs, lambda i, per_group=per_group: i // per_group in groups)
            out.append((name, (sum(n for _, _, n in mine), *shape[1:]), mine))
        return out
    if transform == "qkv_z_b_a":  # Qwen3.5: vLLM fuses [q|k|v|z] and [b|a], each rank its heads' parts
        nv = arch.linear_value_heads
        qk, vd = arch.linear_key_heads * arch.linear_key_dim, nv * arch.linear_value_dim
        out, full = [], 0
        for name, sections in ((names[0].replace("in_proj_qkv", "in_proj_qkvz"), (qk, qk, vd, vd)),
                               (names[2].replace("in_proj_b", "in_proj_ba"), (nv, nv))):
            runs, dst = [], 0
            for size in sections:
                n = size // tp
                runs.append((full + t * n, dst, n))
                full, dst = full + size, dst + n
            out.append((name, (dst, *shape[1:]), runs))
        return out
    if canonical.endswith(HEAD_SPLIT):
        qk, vd = arch.linear_key_heads * arch.linear_key_dim, arch.linear_value_heads * arch.linear_value_dim
        sections = (qk, qk, vd) if canonical.endswith("conv1d.weight") else (shape[0],)
        runs, full, dst = [], 0, 0
        for size in sections:
            n = size // tp
            runs.append((full + t * n, dst, n))
            full, dst = full + size, dst + n
        return [(names[0], (dst, *shape[1:]), runs)]
    return None
