"""The TransformerConfig fields of the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5-MoE's text model).

Owns: (1 + w) RMSNorms (Megatron's zero-centered gamma), the full attention's sigmoid output gate,
the shared expert and its gate, the linear attention's shapes (read by megarl's GatedDeltaNet),
and what the hybrids cannot run yet, refused by name.
"""

from megarl.models.hf.config import ModelArch
from megarl.parallel_state.dims import ParallelDims


def hybrid_fields(arch: ModelArch, dims: ParallelDims, use_te: bool) -> dict:
    """Pure: nothing for the other families."""
    fields = {}
    if arch.zero_centered_norm:
        fields["layernorm_zero_centered_gamma"] = True
    if arch.attention_output_gate:
        fields["attention_output_gate"] = True
    if arch.shared_expert_gate:
        fields.update(moe_shared_expert_intermediate_size=arch.shared_expert_ffn,
                      moe_shared_expert_gate=True)
    if not any(arch.is_linear_layer(layer) for layer in range(arch.num_layers)):
        return fields
    if use_te:
        raise ValueError(f"layer_types {list(arch.layer_types)} has linear_attention layers, which "
                         "megarl builds on its portable layers only: set model.transformer_engine="
                         "false (the Gated DeltaNet rule then runs flash-linear-attention's kernel "
                         "when it is installed)")
    if dims.cp > 1:
        raise ValueError(f"context parallel cp={dims.cp} with linear_attention layers (layer_types): "
                         "the Gated DeltaNet's state does not pass between CP ranks; use cp=1")
    for name, heads in (("linear_num_key_heads", arch.linear_key_heads),
                        ("linear_num_value_heads", arch.linear_value_heads)):
        if heads % dims.tp:
            raise ValueError(f"{name}={heads} must be divisible by tp({dims.tp})")
    fields.update(
        # Megatron's pattern (1: linear attention); it makes distributed checkpoints keep each
        # layer's tensors apart, as the two kinds of layers hold different ones.
        linear_attention_freq=[int(arch.is_linear_layer(layer)) for layer in range(arch.num_layers)],
        linear_conv_kernel_dim=arch.linear_conv_kernel,
                  linear_key_head_dim=arch.linear_key_dim,
                  linear_value_head_dim=arch.linear_value_dim,
                  linear_num_key_heads=arch.linear_key_heads,
                  linear_num_value_heads=arch.linear_value_heads)
    return fields
