"""The Gated DeltaNet hybrids' own tensors as the training ranks hold them (Qwen3-Next,
Qwen3.5-MoE), for source_layout's planner without weights: local shapes, the TP dimension, and
the parts sharded apart (param_layout.ParamSlot.sections), as megarl's GatedDeltaNet and the gated
attention build them."""

from typing import Dict, Optional, Tuple

from megarl.models.hf.config import ModelArch

Shape = Tuple[Tuple[int, ...], Optional[int], bool]


def hybrid_sections(arch: ModelArch) -> Dict[str, Tuple[int, ...]]:
    """Full sizes of the parts each TP rank holds a shard of, by the name after the layer prefix."""
    nv = arch.linear_value_heads
    qk, vd = arch.linear_key_heads * arch.linear_key_dim, nv * arch.linear_value_dim
    return {"self_attention.in_proj.weight": (qk, qk, vd, vd, nv, nv),
            "self_attention.conv1d.weight": (qk, qk, vd),
            "self_attention.dt_bias": (nv,), "self_attention.A_log": (nv,)}


def hybrid_shapes(arch: ModelArch, tp: int) -> Dict[str, Shape]:
    """(local shape, TP dimension, glu) of the hybrid's tensors the other families lack."""
    h, d = arch.hidden_size, arch.head_dim
    sections = hybrid_sections(arch)
    vd = arch.linear_value_heads * arch.linear_value_dim
    gated_qkv = (2 * arch.num_heads + 2 * arch.num_kv_heads) * d
    in_proj, conv = (sum(sections[f"self_attention.{n}.weight"]) for n in ("in_proj", "conv1d"))
    return {
        "self_attention.in_proj.weight": ((in_proj // tp, h), 0, False),
        "self_attention.conv1d.weight": ((conv // tp, 1, arch.linear_conv_kernel), 0, False),
        "self_attention.dt_bias": ((arch.linear_value_heads // tp,), 0, False),
        "self_attention.A_log": ((arch.linear_value_heads // tp,), 0, False),
        "self_attention.out_norm.weight": ((arch.linear_value_dim,), None, False),
        "self_attention.out_proj.weight": ((h, vd // tp), 1, False),
        "self_attention.linear_qkv.weight": ((gated_qkv // tp, h), 0, False),
        "mlp.shared_experts.gate_weight": ((1, h), None, False),
    }
